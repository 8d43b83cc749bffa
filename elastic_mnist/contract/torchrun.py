"""The torchrun settings an elastic job needs, in one place: the local launcher, the Kubernetes
manifests (checked by tests/test_k8s.py) and the README all use these.

    python -c "from elastic_mnist.contract.torchrun import torchrun_args; print(torchrun_args('etcd'))"
"""

from __future__ import annotations

# What torchrun's agent may restart after workers of its own node failed. Under etcd-v3 a membership change
# (a peer killed, preempted or joining) counts nothing (rendezvous/_budget.py), and own failures are also
# limited by rate there; under the legacy etcd and c10d backends every peer's departure counts one, so a
# long spot run on those needs a budget far above its expected number of changes.
MAX_RESTARTS = 100

# How often the agent checks its workers and the rendezvous for waiting nodes. torch's default; each tick
# reads the rendezvous state (one small etcd key), cheap next to noticing a failed worker or a joining node late.
MONITOR_INTERVAL = 0.1

# Rendezvous timing per backend. last_call_timeout is how long a round stays open for late joiners
# after min nodes arrived: torch's 30 s default is the bulk of a recovery.
RDZV_CONF = {
    "etcd": {"timeout": 600, "last_call_timeout": 1},
    "etcd-v3": {"join_timeout": 600, "last_call_timeout": 1, "keep_alive_interval": 1, "keep_alive_max_attempt": 3},
    # torch's own backend, left at torch's defaults: the baseline a spot replay compares with. Its store
    # is a TCP server inside the first agent that binds the endpoint.
    "c10d": {},
}


def rdzv_conf(backend: str, extra: dict | None = None) -> str:
    return ",".join(f"{k}={v}" for k, v in {**RDZV_CONF[backend], **(extra or {})}.items())


def torchrun_args(backend: str, endpoint: str, run_id: str, min_nodes: int = 1, max_nodes: int = 4,
                  nproc_per_node: int | str = 1, conf: dict | None = None,
                  max_restarts: int = MAX_RESTARTS) -> list[str]:
    """The torchrun flags for one node of an elastic job (the program and its flags follow); `conf`: more
    --rdzv-conf keys (the user's), over the tuned ones."""
    return [
        f"--nnodes={min_nodes}:{max_nodes}",
        f"--nproc-per-node={nproc_per_node}",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        *([f"--rdzv-conf={rdzv_conf(backend, conf)}"] if RDZV_CONF[backend] or conf else []),
        f"--max-restarts={max_restarts}",
        f"--monitor-interval={MONITOR_INTERVAL}",
    ]
