"""The control plane: the per-step agreement and peer liveness, on small gloo groups beside the data group.

    torchrun ... -m elastic_mnist.train --peer-timeout 5     # what a frozen peer may cost, at most

Why apart from the data path: a data collective does not always notice a dead peer (a gloo send can wait
for its full timeout, an NCCL kernel spins until the watchdog), and the worker must not wait a minute
to learn what a heartbeat shows in seconds. Two gloo groups (CPU, TCP) exist beside the data group:
- the agreement group: one all-reduce per step of (loss, stop, superseded), so every rank decides alike;
- the watch group, driven by a thread: one tiny all-reduce every --heartbeat-interval seconds. A killed
  peer resets its TCP connections, so the heartbeat fails at once; a frozen peer misses it and the
  heartbeat fails after --peer-timeout. Either way `on_peer_lost` runs on that thread.
- a beat in flight for SUSPECT_S makes a third thread probe the round's other nodes' agent beacons
  (netprobe.py; the etcd-v3 agent hands their addresses to its workers): a host that stays silent, or an
  agent that accepts but does not answer (frozen), on two probes in a row, is lost at once, well within
  --peer-timeout. A slow peer on a loaded host still answers (its kernel and its agent's beacon thread
  do), so load alone never loses one; without beacons (other backends) the timeout alone decides.
- the alarm: a rank that finds a peer lost says so under this round's key in the round's store, and every
  rank polls that key (ALARM_POLL_S). A collective only fails where it touches the dead peer: in a ring of 4
  or more, the ranks two hops away would wait on a live neighbour that gave the round up until their own
  timeout. The store lives in rank 0's process, so its failure is rank 0's loss (unless the round is ending).
Leaving is agreed through the heartbeat itself (a `leaving` flag), so a rank that finishes first never
makes the others believe it died.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from elastic_mnist import netprobe
from elastic_mnist.compat import private as compat
from elastic_mnist.contract.keys import ALARM_KEY, CONTROL_PREFIX
from elastic_mnist.distributed import bury, group_device, wait
from elastic_mnist.worker.stop import StopRequest

SUSPECT_S = 0.25  # a heartbeat takes milliseconds: one in flight this long has the peers' hosts probed
PROBE_S = 0.3  # each probe's timeout; two bad ones in a row (two SYNs: one lost packet is no fault)
ALARM_POLL_S = 0.05  # how often each rank looks for another's loss notice (one small store request)
STORE_GRACE_S = 0.1  # a store that fails this long after a stop was agreed is rank 0 ending its round, not lost


class ControlPlane:
    def __init__(self, world_size: int, config, stop: StopRequest | None = None,
                 beacons: dict[str, str] | None = None):
        self.world_size, self.heartbeat_s = world_size, config.heartbeat_interval
        self.stop = stop or StopRequest()
        self.peer_lost = threading.Event()
        self.lost_at: float | None = None
        self.lost_reason = ""
        self._leaving = threading.Event()
        self._beacons = dict(beacons or {})
        self._in_flight_since: float | None = None  # the beat on the wire, if any
        self._lost_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ending = threading.Event()  # a stop was agreed: the round's store may go with rank 0's teardown
        self._rang = threading.Event()  # this rank rang the alarm
        # Under torch's agent store (c10d) the store is node 0's agent's, not rank 0's: its end says nothing.
        self._store_is_rank0 = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)
        self._agree_group = self._watch_group = self._alarm = None
        if world_size > 1:
            prefix = f"{CONTROL_PREFIX}/{_round_token()}"
            self._agree_group = _gloo_group(f"{prefix}/agree", config.collective_timeout)
            self._watch_group = _gloo_group(f"{prefix}/watch", config.peer_timeout)
            self._alarm = dist.PrefixStore(f"{prefix}/alarm", compat.default_store())

    def agree(self, values: list[float]) -> list[float]:
        """Sum over ranks, on the agreement group (a lone process agrees with itself)."""
        if self._agree_group is None:
            return values
        packed = torch.tensor(values, dtype=torch.float64)
        wait(self._agree_group.allreduce([packed]), gloo=True)
        return packed.tolist()

    def watch(self, on_peer_lost: Callable[[str], None]) -> None:
        """Start the heartbeat thread; on_peer_lost(reason) runs on it once when a peer is lost."""
        if self._watch_group is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._beat, args=(on_peer_lost,), daemon=True, name="peer-watch")
        self._thread.start()
        if self._beacons:
            threading.Thread(target=self._probe_late, args=(on_peer_lost,), daemon=True, name="peer-probe").start()
        threading.Thread(target=self._listen, args=(on_peer_lost,), daemon=True, name="peer-alarm").start()

    def alarm(self) -> None:
        """Tell every rank of this round that a peer is lost (best effort, off this thread: the store may be
        the lost rank's)."""
        if self._alarm is not None and not self._rang.is_set():
            self._rang.set()  # this rank knows: its own listener stands down
            threading.Thread(target=self._ring, daemon=True, name="peer-alarm-ring").start()

    def ending(self) -> None:
        """A stop was agreed: the round ends together, and the store with rank 0's teardown."""
        self._ending.set()

    def _ring(self) -> None:
        try:  # a read first: on a store gone with rank 0 it fails quietly, where a write logs a C++ trace
            if not self._alarm.check([ALARM_KEY]):
                self._alarm.set(ALARM_KEY, b"1")
        except Exception:  # noqa: BLE001 - the store went with rank 0: every rank sees that itself
            pass

    def _listen(self, on_peer_lost: Callable[[str], None]) -> None:
        while not (self.peer_lost.is_set() or self._leaving.wait(ALARM_POLL_S)):
            try:
                rung = self._alarm.check([ALARM_KEY])
            except Exception as e:  # noqa: BLE001 - the store's host is rank 0's process
                if self._ending.wait(STORE_GRACE_S) or self._leaving.is_set() or not self._store_is_rank0:
                    return
                self._lose(f"the round's store failed (rank 0 lost): {str(e).splitlines()[0][:160]}", on_peer_lost)
                return
            if self._leaving.is_set() or self._rang.is_set():
                return  # the round is over, or this rank found the loss itself
            if rung:
                self._lose("another rank of this round lost a peer", on_peer_lost)
                return

    def _beat(self, on_peer_lost: Callable[[str], None]) -> None:
        beat = torch.zeros(1)
        while True:
            beat.fill_(1.0 if self._leaving.is_set() else 0.0)
            self._in_flight_since = time.monotonic()
            try:
                wait(self._watch_group.allreduce([beat]), gloo=True)  # ends when a loss found elsewhere ends the round
            except Exception as e:  # noqa: BLE001 - any failure of the heartbeat means a peer is gone
                if self._leaving.is_set():
                    return  # we were leaving anyway; a peer that left first is no loss
                self._lose(str(e).splitlines()[0][:200], on_peer_lost)
                return
            finally:
                self._in_flight_since = None
            if beat.item() > 0:
                return  # some rank is leaving: everyone stops beating after this same round
            self._leaving.wait(self.heartbeat_s)

    def _lose(self, reason: str, on_peer_lost: Callable[[str], None]) -> None:
        with self._lost_lock:  # the heartbeat's failure and the probe may both find the loss: one report
            if self.peer_lost.is_set():
                return
            self.lost_at, self.lost_reason = time.time(), reason
            self.peer_lost.set()
        self.alarm()
        on_peer_lost(reason)

    def _probe_late(self, on_peer_lost: Callable[[str], None]) -> None:
        """While a beat is late, probe the peers' beacons; two bad verdicts in a row for a node lose it."""
        strikes: dict[str, int] = {}
        beat_of_strikes = None
        while not self.peer_lost.is_set() and not self._leaving.is_set():
            since = self._in_flight_since
            if since is None or time.monotonic() - since < SUSPECT_S:
                self._leaving.wait(0.05)
                continue
            if since != beat_of_strikes:  # a new late beat: the last one's verdicts are history
                strikes, beat_of_strikes = {}, since
            verdicts = netprobe.check(self._beacons, PROBE_S)
            strikes = {n: strikes.get(n, 0) + 1 for n, v in verdicts.items() if v != "ok"}
            lost = sorted(n for n, count in strikes.items() if count >= 2)
            if lost and self._in_flight_since == since and not self._leaving.is_set():
                said = ", ".join(f"{n} {'unreachable' if verdicts[n] == 'silent' else 'frozen'}" for n in lost)
                self._lose(f"heartbeat late and its host probed twice: {said}", on_peer_lost)
                return

    def leave(self, timeout_s: float = 10.0) -> None:
        """Stop the heartbeat together with the other ranks (safe to repeat). After a lost peer its groups are
        kept referenced past the round: a collective of theirs may still wait on the dead peer."""
        self._leaving.set()
        if self._thread is not None:
            # After a loss the beat may wait on the lost peer until --peer-timeout: not worth waiting for.
            self._thread.join(0 if self.peer_lost.is_set() else timeout_s)
        stuck = self._thread is not None and self._thread.is_alive()
        if (self.peer_lost.is_set() or stuck) and self._agree_group is not None:
            bury(self._agree_group)
            bury(self._watch_group)

    def confirms_peer_loss(self, timeout_s: float) -> bool:
        """An error from a collective is a peer's loss when the heartbeat says so (no message matching)."""
        return self.peer_lost.wait(timeout_s)


THREAD_PREFIX = "peer-"  # every thread of a control plane is named so


def threads_ended(timeout_s: float) -> bool:
    """Wait, at most `timeout_s` in all, for the threads of ended rounds' control planes (a lost round's
    listener and prober end within a poll): until then they hold its groups. Off the recovery's path."""
    deadline = time.monotonic() + timeout_s
    for thread in [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.name.startswith(THREAD_PREFIX) for t in threading.enumerate())


def _round_token() -> int:
    """A number every rank of this round agrees on (rank 0's, broadcast over the data group). The store
    torchrun hands workers can outlive a round (the c10d backend shares one across rounds), so groups
    keyed by a fixed name would meet the addresses of the previous round's dead processes there."""
    # os.urandom, not torch's RNG (which training seeds and checkpoints).
    token = torch.tensor([int.from_bytes(os.urandom(7), "big")], dtype=torch.int64, device=group_device())
    wait(dist.broadcast(token, src=0, async_op=True))
    return int(token.item())


def _gloo_group(prefix: str, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over all ranks, on its own keys of the default store."""
    store = dist.PrefixStore(prefix, compat.default_store())
    return compat.gloo_group(store, dist.get_rank(), dist.get_world_size(), timeout_s)
