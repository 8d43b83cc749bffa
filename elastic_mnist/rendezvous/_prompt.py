"""Rounds that complete as soon as they can, on torch's own rendezvous protocol.

    torchrun --rdzv-backend=etcd-v3 ...    # applied by create_rdzv_handler; peer_probe=0 turns probing off

torch's DynamicRendezvousHandler is correct but unhurried. It waits `last_call_timeout` for late
joiners even when every live node is already in, it sleeps one second before each new look at the
state, it caches the state for one second (so an agent notices a joining node up to 1.5 s late), and it
keeps a SIGKILLed node in the round until its heartbeat is older than the keep-alive window. Here:

- `RoundView` is what torch is shown of every state it reads: the heartbeat of a participant whose
  beacon refuses connections (_liveness.py) is aged out, so torch's own sanitizer drops it now; every
  other heartbeat is aged on this agent's own monotonic clock, never another host's wall clock
  (_clock.py); and an open round (after the first) whose participants are every node with a live
  heartbeat gets a last-call deadline in the past, so the next node to look completes it. `restore`
  undoes the clock rewrite in what torch writes back.
- `make_prompt` gives the handler a state holder without the 1 s cache, and an op executor that, where
  torch would sleep 1 s, waits for the state key to change (an etcd watch), for at most that second.

The protocol (who may write what, the fencing token) is torch's, unchanged.
"""

from __future__ import annotations

import pickle
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

from elastic_mnist.compat import private as compat
from elastic_mnist.compat.private import (
    Action,
    BackendRendezvousStateHolder,
    DistributedRendezvousOpExecutor,
    DynamicRendezvousHandler,
    RendezvousContext,
    RendezvousExitOp,
    RendezvousJoinOp,
)
from elastic_mnist.etcd.client import EtcdV3Error
from elastic_mnist.rendezvous._clock import LONG_AGO, HeartbeatClock
from elastic_mnist.rendezvous._liveness import RECHECK_S, PeerLiveness
from elastic_mnist.rendezvous._partition import losing_side

__all__ = ["LONG_AGO", "POLL_S", "PromptOpExecutor", "RoundView", "close_when_everyone_is_in", "make_prompt"]
POLL_S = 1.0  # torch's pause between looks at the state; now the longest wait for a change
HOLD_S = 1.0  # a node on the losing side of a partition looks at the state again after this long


class RoundView:
    """Applied to each state read from etcd, after `unseal` checked it (so it names only torch's classes)."""

    def __init__(self, window: timedelta, liveness: PeerLiveness | None,
                 last_call: timedelta = timedelta(seconds=1)) -> None:
        self.window, self.liveness = window, liveness
        self.clock = HeartbeatClock(window, last_call)
        # Found dead by this agent, with the heartbeat each had then: a dead agent writes no newer one, so
        # a stale state naming it is aged again, and a newer heartbeat means it lives (a refusal we got
        # wrong, or an agent back under the same name).
        self._dead: dict[str, datetime] = {}
        # The side of a partial partition this node is not on (_partition.py), as of the last state read.
        self.cut_off, self.side = False, frozenset()
        self._alive: set[str] = set()  # the nodes the last decision was made over
        self._said = ""
        self.hiding = False  # the last state read had nodes hidden for a partition
        self.read: tuple[int, bool, frozenset[str]] | None = None  # (round, complete and open, members) in etcd
        self.beating: frozenset[str] = frozenset()  # every node with a heartbeat in that state, as written
        self.incumbents: frozenset[str] = frozenset()  # the members of the last completed round read
        self._incumbent_round = -1
        self.stale_s = 0.5 * window.total_seconds()  # no beat for this long: probed for a frozen agent
        self._look_by: float | None = None  # monotonic: when a forming round should be looked at again
        self.closed = False  # the last state read was closed (the job finished or ended)

    def __call__(self, state_bits: bytes) -> bytes:
        state = pickle.loads(state_bits)  # noqa: S301 - checked by unseal (restricted unpickler, HMAC)
        self.read = (state.round, state.complete and not state.closed, frozenset(map(str, state.participants)))
        self.beating = frozenset(map(str, state.last_heartbeats))
        if self.read[1]:
            self._note_incumbents(state.round, self.read[2])
        self.closed = bool(state.closed)
        changed = self._drop_dead(state)  # on the values as written: a dead node's last one is remembered
        changed = self.clock.present(state) or changed
        self._note_next_look(state)
        # A node hidden for a partition may be hidden on a report its author has not refreshed yet (it
        # re-probes as soon as the node waits to join): such a round keeps torch's last call, not less.
        if not self.hiding:
            changed = close_when_everyone_is_in(state, self.window) or changed
        return pickle.dumps(state) if changed else state_bits

    def _note_incumbents(self, round_: int, members: frozenset[str]) -> None:
        # The partition rule's tie-break prefers them (_partition.py). Members leave a completed round one
        # by one when the next forms (it stays complete until the last has left): every member ever read
        # in it counts, so that whoever reads during those exits still names the same nodes.
        same = round_ == self._incumbent_round
        self.incumbents, self._incumbent_round = (self.incumbents | members if same else members), round_

    def _note_next_look(self, state) -> None:
        # While a round forms, a frozen peer writes nothing: the state does not change, and the watch would
        # only wake a waiting agent a whole poll later. Look again when the next heartbeat turns stale
        # (then its agent is probed), or, once stale, when it may be probed again.
        self._look_by = None
        if self.liveness is None or state.closed or not _forming(state):
            return
        waits = [RECHECK_S if age > self.stale_s else self.stale_s - age for age in
                 (self.clock.age(str(node)) for node, beat in state.last_heartbeats.items()
                  if beat != LONG_AGO and str(node) != self.liveness.own)]
        if waits:
            self._look_by = time.monotonic() + min(waits)

    def next_look(self, longest: float) -> float:
        """How long a waiting agent may wait for the state to change before it looks again (at most `longest`)."""
        if self._look_by is None:
            return longest
        return min(longest, max(0.05, self._look_by - time.monotonic()))

    def restore(self, state_bits: bytes) -> bytes:
        """A state torch is about to write, with every heartbeat it did not change back as its node wrote it."""
        state = pickle.loads(state_bits)  # noqa: S301 - torch's own pickle of the state it holds
        self.clock.restore(state)
        return pickle.dumps(state)

    def _drop_dead(self, state) -> bool:
        # Probing only while a round forms: a steady job costs no connections. Every node with a
        # heartbeat is probed: participants, waiting nodes, and nodes between their exit and re-join.
        forming = _forming(state)
        if self.liveness is not None and state.complete and not state.closed:
            # once per round: whom to ask if etcd goes away, whom the workers probe
            self.liveness.learn_peers(state.round, map(str, state.participants))
        self.hiding = False
        if self.liveness is None or state.closed or not forming or not state.last_heartbeats:
            return False
        names = {str(node): node for node in state.last_heartbeats}
        beats = {name: state.last_heartbeats[node] for name, node in names.items()}
        self._dead = {n: beat for n, beat in self._dead.items() if n not in beats or beats[n] <= beat}
        # No heartbeat for half the window (a beat is due every third of it) and an agent that does not
        # answer its beacon: frozen (liveness.gone). Silent nodes are the partition rule's business.
        stale = {n for n in names if self.clock.age_of(n, beats[n]) > self.stale_s}
        for name in self.liveness.gone(names.keys() - self._dead.keys(), stale):
            self._dead[name] = beats[name]
            self._forget(name)
        dead = self._dead.keys() & names.keys()
        self._alive = names.keys() - dead
        partitioned = self._partitioned(self._alive)
        self.hiding = bool(partitioned)
        hidden = dead | partitioned
        for name in hidden:
            state.last_heartbeats[names[name]] = LONG_AGO
        return bool(hidden)

    def _partitioned(self, alive: set[str]) -> set[str]:
        """The other nodes to hide: those on the losing side of a partition, when this node is not."""
        own = self.liveness.own
        reports = {**self.liveness.reports, **({own: self.liveness.unreachable} if own else {})}
        losing = losing_side(alive, reports, self.incumbents)
        self.cut_off = own in losing
        self.side = frozenset(alive - losing) if losing else frozenset()
        if self.cut_off:
            self._say(f"cannot reach {', '.join(sorted(self.side))} (silent while etcd answers: a partition); the "
                      "job goes on there, this node waits without starting workers and rejoins once it can")
        return set() if self.cut_off else losing

    def hold(self, seconds: float) -> bool:
        """On the losing side: wait up to `seconds` for this host to reach the winning side; True while it
        still cannot (the caller looks at the state again, which re-reads every report)."""
        deadline = time.monotonic() + seconds
        while self.cut_off and self.liveness is not None:
            if self._decide_again() or self.liveness.reaches(self.side):
                self.cut_off = False
            elif time.monotonic() < deadline:
                time.sleep(RECHECK_S)
            else:
                return True
        return False

    def _decide_again(self) -> bool:
        """The others' newest reports may put this node on the winning side: the peers that detected a
        loss at the same moment as this one publish theirs a moment later (a vanished rank 0 of three:
        each survivor alone sees a tie with the vanished node, which the lowest name would win)."""
        try:
            self.liveness.read_reports()
        except (EtcdV3Error, OSError):
            return False
        self._partitioned(self._alive)
        return not self.cut_off

    def _forget(self, name: str) -> None:
        try:
            self.liveness.forget(name)
        except Exception:  # noqa: BLE001 - its lease expires it anyway; dropping the node matters more
            pass

    def _say(self, line: str) -> None:
        # once, not on every look at the state: on the agent's stderr (what `kubectl logs` and the node logs show)
        if line != self._said:
            self._said = line
            print(f"elastic-mnist etcd-v3: {self.liveness.own}: {line}", file=sys.stderr, flush=True)


def _forming(state) -> bool:
    """A round is forming: it is open, or someone waits to join the next one."""
    return not state.complete or bool(state.wait_list)


def close_when_everyone_is_in(state, window: timedelta) -> bool:
    """Move an open round's last-call deadline to the past when every node with a live heartbeat (one
    younger than the keep-alive window, as torch's sanitizer counts) is a participant.

    Nodes in the wait or redundancy list, or joining (they all heartbeat), keep the round open as before.
    Round 0 keeps its last call: on a cold start nobody knows how many nodes are coming."""
    if state.complete or state.closed or state.round == 0 or state.deadline is None or not state.participants:
        return False
    oldest = datetime.now(timezone.utc) - window
    alive = {node for node, beat in state.last_heartbeats.items() if beat >= oldest}
    if not alive <= set(state.participants):
        return False
    state.deadline = LONG_AGO
    return True


class PromptOpExecutor(DistributedRendezvousOpExecutor):
    """torch's op executor, except that a state handler's SYNC (nothing to do but look again) waits for
    the state to change rather than sleeping: the handler only sees actions that act."""

    def __init__(self, handler: DynamicRendezvousHandler, wait_for_change: Callable[[float], bool]) -> None:
        super().__init__(compat.handler_node(handler), compat.handler_state_holder(handler),
                         compat.handler_settings(handler))
        self._wait_for_change = wait_for_change
        self._rejoining = False
        self.view: RoundView | None = None  # set by make_prompt: whose hold() a join waits on

    def run(self, state_handler, deadline: float, update_deadline=None) -> None:
        # torch's next_rendezvous runs its plain exit op, then a join op: this node is coming straight back.
        self._rejoining = type(state_handler) is RendezvousExitOp
        joining = type(state_handler) is RendezvousJoinOp  # not the keep-alive: its heartbeat goes on

        def prompt(ctx: RendezvousContext, deadline: float) -> Action:
            while True:
                # Cut off from the winning side of a partition: no join (and no workers) until it is
                # reachable; looked at before every action, also while waiting in the wait list.
                while joining and self.view is not None and time.monotonic() < deadline and self.view.hold(HOLD_S):
                    ctx = self._look_again()
                action = state_handler(ctx, deadline)
                if action != Action.SYNC:
                    return action
                self._wait_for_change(POLL_S if self.view is None else self.view.next_look(POLL_S))
                ctx = self._look_again()

        super().run(prompt, deadline, update_deadline)

    def _look_again(self) -> RendezvousContext:
        self._state_holder.sync()
        # torch's loop acts on self._state: it must be the state the action was chosen from.
        self._state = self._state_holder.state
        return RendezvousContext(self._node, self._state, self._settings)

    def _remove_from_participants(self) -> None:
        super()._remove_from_participants()
        if self._rejoining:
            # torch drops the heartbeat too; kept, it tells the others that a live node is on its way into
            # the next round, so they do not complete it without us (close_when_everyone_is_in).
            self._state.last_heartbeats[self._node] = datetime.now(timezone.utc)


def make_prompt(handler: DynamicRendezvousHandler, backend) -> None:
    """Swap in the uncached state holder and the prompt executor (waiting on `backend.wait_for_change`),
    before the handler's first use."""
    compat.set_state_holder(handler, BackendRendezvousStateHolder(backend, compat.handler_settings(handler),
                                                                  cache_duration=0))
    executor = PromptOpExecutor(handler, backend.wait_for_change)
    executor.view = getattr(backend, "view", None)
    compat.set_op_executor(handler, executor)
    # torch waits a random 0-0.3 s before a node's first join while the state it holds says round 0, to
    # spread a cold start's first writes. Read once now, a node joining a running job knows its round and
    # joins at once; on a cold start the state is still round 0 and the spread stays.
    compat.handler_state_holder(handler).sync()

