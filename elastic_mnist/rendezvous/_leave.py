"""An agent that exits while the rendezvous goes on (SIGTERM: a spot preemption, a pod deleted) leaves it.

    torchrun --rdzv-backend=etcd-v3 ...    # registered by create_rdzv_handler; nothing to configure

torch's launcher deliberately does not shut the rendezvous down when its agent dies of a signal (that
would close the job for everyone), so the agent just disappears and the survivors wait until its
heartbeat is older than keep_alive_interval x keep_alive_max_attempt before they re-form. At the exit
of the agent's process we instead run torch's own exit operation, the one `next_rendezvous` runs
before it joins: this node leaves the participants and its heartbeat goes, the state moves on to the
next round, and the survivors' next poll sees it. A closed rendezvous (a finished job) is left alone,
and so is everything when etcd cannot be reached at once: then the heartbeat window drops us as before.
A SIGKILLed agent runs nothing; the heartbeat window remains the bound there.

The exit never waits more than EXIT_WAIT_S for any of it. torchrun's SIGTERM handler raises in the
agent's main thread wherever that thread is, and when that is inside a gRPC call (the monitor loop polls
etcd ten times a second) it can leave that channel's lock held for good. The keep-alive thread then
blocks on the lock at its next beat, and torch's heartbeat stop joins that thread without a timeout. So
the leave runs in a thread the exit waits for at most EXIT_WAIT_S, over a new channel, and the heartbeat
stop gets HEARTBEAT_STOP_S of its own.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable

from elastic_mnist.compat import private as compat
from elastic_mnist.compat.private import Action, DynamicRendezvousHandler, RendezvousContext, RendezvousExitOp
from elastic_mnist.etcd.client import EtcdV3Client
from elastic_mnist.rendezvous._liveness import PeerLiveness

LEAVE_TIMEOUT_S = 5.0
HEARTBEAT_STOP_S = 1.0
EXIT_WAIT_S = LEAVE_TIMEOUT_S + HEARTBEAT_STOP_S + 1.0
log = logging.getLogger(__name__)


class _LeaveOp(RendezvousExitOp):
    """torch's exit operation, except on a closed rendezvous: a finished job's state stays as it ended."""

    def __call__(self, ctx: RendezvousContext, deadline: float) -> Action:
        return Action.FINISH if ctx.state.closed else super().__call__(ctx, deadline)


def leave(handler: DynamicRendezvousHandler, client: EtcdV3Client, liveness: PeerLiveness | None = None) -> None:
    """Best effort, bounded: no waiting out an etcd outage on the way out, nor a lock a signal left held."""
    if not _within(EXIT_WAIT_S, _leave, handler, client, liveness):
        log.info("leaving the rendezvous took over %.0f s; exiting without it (the heartbeat window still "
                 "drops this node)", EXIT_WAIT_S)


def _leave(handler: DynamicRendezvousHandler, client: EtcdV3Client, liveness: PeerLiveness | None) -> None:
    client.ride_out_outages = False
    client.fresh_channel()  # the old one may hold a lock for good (see above)
    _within(HEARTBEAT_STOP_S, compat.stop_heartbeats, handler)  # a stuck beat cannot send after we leave
    try:
        compat.handler_op_executor(handler).run(_LeaveOp(), time.monotonic() + LEAVE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - leaving is an optimization; the heartbeat window still holds
        log.info("could not leave the rendezvous at exit (%s); the others drop this node by its heartbeat", exc)
    try:
        if liveness is not None:
            liveness.close()
    except Exception as exc:  # noqa: BLE001 - its key expires with the agent's lease
        log.info("could not remove this agent's beacon key at exit (%s)", exc)


def _within(seconds: float, fn: Callable[..., object], *args: object) -> bool:
    """Run `fn` in a daemon thread; False if it has not returned after `seconds` (it is left behind)."""
    thread = threading.Thread(target=fn, args=args, daemon=True, name=f"rdzv-exit-{fn.__name__}")
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def leave_at_exit(handler: DynamicRendezvousHandler, client: EtcdV3Client,
                  liveness: PeerLiveness | None = None) -> None:
    atexit.register(leave, handler, client, liveness)
