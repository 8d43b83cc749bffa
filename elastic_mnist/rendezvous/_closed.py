"""A torchrun started on a closed rendezvous ends at once with one line, before its agent starts.

    torchrun --rdzv-backend=etcd-v3 --rdzv-id=job1 ...    # after job1 finished: one line, exit 0

torch's agent meets a closed rendezvous as RendezvousClosedError in its first join and exits 1 with a
40-line traceback; the RendezvousGracefulExitError meant for such exits does not help either: torch
2.14's SimpleElasticAgent.run() catches it and returns None, and launch_agent() then fails on
`result.is_failed()`. So create_rdzv_handler (etcd_v3.py) asks here first, with what the backend
already read, and ends the process itself. `@record` around torchrun's main turns SystemExit(0)
into a normal return, and nothing has started yet (no workers, no store server, no heartbeats).

Finished or given up? torch closes the rendezvous in both cases (the agent's shutdown). Only a
successful end passes the agents' exit barrier first: every agent of the last round adds itself to
`torch.rendezvous.<run_id>.<round>/torchelastic/agent/terminal_state/num_members` in the rendezvous
store and the last one sets `.../last_member` (torch.distributed.elastic.utils.store.barrier, called
by SimpleElasticAgent._exit_barrier only when the worker group SUCCEEDED). That key is the proof.
"""

from __future__ import annotations

import sys

from torch.distributed import Store

from elastic_mnist.compat.private import exit_barrier_key, round_store_prefix
from elastic_mnist.contract.exit_codes import OK, PERMANENT
from elastic_mnist.contract.keys import CONFIG_ERROR_KEY
from elastic_mnist.etcd.rdzv_state import decode_state


def closed_verdict(run_id: str, state_bits: bytes | None, store: Store) -> tuple[int, str] | None:
    """(exit code, line) for a closed rendezvous, None while it is open (or absent)."""
    if state_bits is None:
        return None
    state = decode_state(state_bits)
    if not state.closed:
        return None
    if store.check([CONFIG_ERROR_KEY]):
        reason = store.get(CONFIG_ERROR_KEY).decode(errors="replace")
        return PERMANENT, (f"rendezvous {run_id} is closed: a configuration error ended the job ({reason}); fix it "
                           "and start again with a new --rdzv-id (nothing was deleted)")
    if store.check([f"{round_store_prefix(run_id, state.round)}{exit_barrier_key()}"]):
        return OK, (f"rendezvous {run_id} is closed: the job finished (every node of round {state.round} "
                    "succeeded); nothing to do")
    return PERMANENT, (f"rendezvous {run_id} is closed but the job did not finish (a node gave up): see the "
                       "failed nodes' logs; start again with a new --rdzv-id to resume from the newest checkpoint")


def exit_if_closed(run_id: str, state: tuple[bytes, object] | None, store: Store, prefix: str) -> None:
    """End this torchrun with one line if its rendezvous is closed; return if it is open."""
    verdict = closed_verdict(run_id, None if state is None else state[0], store)
    if verdict is not None:
        code, line = verdict
        print(f"{prefix}: {'error: ' if code else ''}{line}", file=sys.stderr, flush=True)
        raise SystemExit(code)
