"""A torchrun on a closed etcd-v3 rendezvous: finished (the agents' exit barrier of the last round is in the
store) or given up (it is not), decided from what a real etcd holds, as create_rdzv_handler sees it.

    python -m pytest -q tests/test_rendezvous_closed.py

(tests/e2e/test_k8s_lifecycle.py runs a real late torchrun after a real job.)
"""

from __future__ import annotations

import pickle

from etcd_fixtures import rdzv_params

from elastic_mnist.compat.private import exit_barrier_key
from elastic_mnist.contract.exit_codes import OK, PERMANENT
from elastic_mnist.rendezvous._closed import closed_verdict
from elastic_mnist.rendezvous.etcd_v3 import create_backend


def _state(round_: int, closed: bool) -> bytes:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    state = _RendezvousState()
    state.round, state.closed = round_, closed
    return pickle.dumps(state)


def test_closed_rendezvous_is_finished_only_after_the_exit_barrier(etcd_server_v3only):
    params = rdzv_params(etcd_server_v3only.endpoint)
    backend, store = create_backend(params)
    try:
        run_id = params.run_id
        assert closed_verdict(run_id, None, store) is None, "no state yet: a first node, nothing to decide"
        _, token, _ = backend.set_state(_state(3, closed=False))
        assert closed_verdict(run_id, backend.get_state()[0], store) is None, "open: join as usual"
        backend.set_state(_state(3, closed=True), token)
        code, line = closed_verdict(run_id, backend.get_state()[0], store)
        assert code == PERMANENT and "did not finish" in line and run_id in line
        # What torch's exit barrier leaves when every agent of round 3 succeeded (an earlier round's
        # barrier does not count).
        store.set(f"torch.rendezvous.{run_id}.2/{exit_barrier_key()}", "<val_ignored>")
        assert closed_verdict(run_id, backend.get_state()[0], store)[0] == PERMANENT
        store.set(f"torch.rendezvous.{run_id}.3/{exit_barrier_key()}", "<val_ignored>")
        code, line = closed_verdict(run_id, backend.get_state()[0], store)
        assert code == OK and "the job finished" in line and "round 3" in line
    finally:
        backend.client.close()
