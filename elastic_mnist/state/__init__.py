"""Everything that survives a restart: the checkpoint format, no-clobber publish, in-memory snapshots, the
agreement on the newest state across ranks, and the one manager that decides what is written where.
It knows nothing of the trainer: it is handed objects with `state_dict()`.

    python -c "from elastic_mnist.state.format import describe_latest; print(describe_latest('checkpoints'))"
"""
