"""A round that loses a member has its workers restarted by every agent still in it.

    torchrun --rdzv-backend=etcd-v3 ...    # applied by create_rdzv_handler; nothing to configure

torch's agent restarts its workers when one of them fails or when a node waits to join (its monitor loop
polls `num_nodes_waiting`). A member that leaves a complete round is neither: a preempted agent taking
itself out at exit (_leave.py), or a killed one dropped once its heartbeat is older than the keep-alive
window. Once the workers train, their own heartbeat notices within a second (worker/control.py). While
they are still starting (a GPU job's CUDA and NCCL set-up, seconds), nothing does: they form the process
group for a rank that never comes, until --connect-timeout. So each agent remembers how many members its
round had when it formed, and counts a member missing from that same round like a node waiting to join.

The same loss can come a moment earlier: rank 0's agent gone (killed, or its SIGTERM raised there) after
the round completed but before it wrote the round's master address to the store. torch's other agents
wait for that key up to the store's timeout (300 s) and then fail, ending the node. Here the wait is
bounded by twice the heartbeat window (at least 10 s; rank 0 writes it a moment after the round completes),
and a node whose wait runs out leaves that round and joins the next, as a restart would.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

from torch.distributed import DistStoreError, Store

from elastic_mnist.compat import private as compat
from elastic_mnist.rendezvous._liveness import PeerLiveness
from elastic_mnist.rendezvous._prompt import RoundView
from elastic_mnist.rendezvous.policy import AgentPolicy, Layer, Methods

# (round, complete and open, members) of the state as last read from etcd
Members = Callable[[], "tuple[int, bool, frozenset[str]] | None"]
ADDRESS_WAIT_MIN = timedelta(seconds=10)
ADDRESS_ATTEMPTS = 3  # rounds whose rank 0 never wrote its address before torch's error is let through


class ShrinkWatch:
    """Counts the members written in etcd, not torch's sanitized copy of them. torch also drops a live node
    whose heartbeat is a moment past the window (a loaded host), and writes that back: a member whose
    agent still answers its beacon is such a one, and its workers train on with ours, as before."""

    def __init__(self, inner: Methods, members: Members, liveness: PeerLiveness | None,
                 store: Store, address_wait: timedelta = ADDRESS_WAIT_MIN) -> None:
        self._members, self._liveness, self._store, self._address_wait = members, liveness, store, address_wait
        self._formed: tuple[int, frozenset[str]] | None = None  # this node's last completed round
        self._next_rendezvous, self._num_nodes_waiting = inner.next_rendezvous, inner.num_nodes_waiting

    def next_rendezvous(self):
        for attempt in range(1, ADDRESS_ATTEMPTS + 1):
            try:
                info = self._join()
                break
            except DistStoreError as exc:  # only our store's wait for rank 0's address raises it in there
                if attempt == ADDRESS_ATTEMPTS:
                    raise
                print(f"elastic-mnist etcd-v3: rank 0 of the round just formed did not write its address within "
                      f"{self._address_wait.total_seconds():.0f}s (its agent left or died as the round formed: "
                      f"{exc}); joining the next round", file=sys.stderr, flush=True)
        read = self._members()
        self._formed = (read[0], read[2]) if read is not None and read[1] else None
        return info

    def _join(self):
        """torch's next_rendezvous, its store wait bounded: the store's only wait in there is for rank 0's
        MASTER_ADDR/MASTER_PORT (RendezvousStoreInfo.build); the agent's later waits keep their timeout."""
        timeout = self._store.timeout
        self._store.set_timeout(self._address_wait)
        read = self._members()
        rejoining = read is not None and read[1]  # a formed round: this node's workers restart, no cold start
        try:
            with compat.without_first_join_delay() if rejoining else contextlib.nullcontext():
                return self._next_rendezvous()
        finally:
            self._store.set_timeout(timeout)

    def num_nodes_waiting(self) -> int:
        waiting = self._num_nodes_waiting()  # torch's: reads the state first
        read = self._members()
        if waiting or self._formed is None or read is None or not read[1] or read[0] != self._formed[0]:
            return waiting
        if self._liveness is None:  # peer_probe=0: no beacon tells a late heartbeat from a lost node
            return waiting
        round_, formed = self._formed
        missing = set(formed - read[2]) - {self._liveness.own}  # us dropped while alive: we train on
        if missing:
            alive = self._liveness.answering(missing)
            self._formed = (round_, formed - alive - {self._liveness.own})  # not asked again this round
            missing -= alive
        if not missing:
            return waiting
        self._formed = None  # said once; the restart forms a new round
        print(f"elastic-mnist etcd-v3: round {round_} lost {', '.join(sorted(missing))} ({len(missing)} of its "
              f"{len(formed)} nodes); restarting this node's workers to form the next round (torch logs it as "
              "a new node)", file=sys.stderr, flush=True)
        return 1


def restart_when_the_round_shrinks(view: RoundView, store: Store) -> Layer:
    """The policy's shrink layer: next_rendezvous and num_nodes_waiting."""
    def layer(inner: Methods, policy: AgentPolicy) -> Methods:
        watch = ShrinkWatch(inner, lambda: view.read, view.liveness, store, max(2 * view.window, ADDRESS_WAIT_MIN))
        return replace(inner, next_rendezvous=watch.next_rendezvous, num_nodes_waiting=watch.num_nodes_waiting)
    return layer
