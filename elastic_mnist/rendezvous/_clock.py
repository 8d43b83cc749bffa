"""Heartbeat freshness on the observer's own monotonic clock, so a node whose wall clock is off still joins.

    torchrun --rdzv-backend=etcd-v3 ...    # applied by RoundView to every state read; nothing to configure

torch's handler writes each node's heartbeat as that node's `datetime.now()` and judges it against the
reader's `datetime.now()`: a node whose clock is 5 s behind (a VM after resume, no NTP) looks dead to
everyone else the moment it writes, and is never admitted. Here a heartbeat's *value* is only a token that
changes when its node beats: `HeartbeatClock.present` replaces it, in what torch is shown, by this agent's
own wall time minus how long ago (on its monotonic clock) it saw that value change. torch's sanitizer and
`close_when_everyone_is_in` then measure an age that no other host's clock enters. The last-call deadline
(written in its writer's clock) is shown as "the last-call timeout after this agent first saw it".

`restore` undoes it in a state torch writes back: a value torch did not touch goes back to what its node
wrote, so no other observer ever mistakes our rewrite for a fresh heartbeat.

A heartbeat first seen more than MAX_SKEW (60 s) past the window by our own wall clock keeps that age:
clocks within a minute of each other are tolerated, a dead node of a reused run id is not revived.

After a gap in our own reads longer than the keep-alive window (etcd was away, or this process was frozen),
every node gets a fresh window from the first read after it: nobody could have written meanwhile, so
nobody is judged for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

LONG_AGO = datetime(1970, 1, 1, tzinfo=timezone.utc)  # a heartbeat, or a last-call deadline, long passed
MAX_SKEW = timedelta(seconds=60)
"""A heartbeat older than this (plus the window) by our wall clock when first seen is a dead node's, not a
skewed clock's: it keeps its wall-clock age, so a reused run id drops its dead nodes at once."""


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


class HeartbeatClock:
    """Remembers, per node, the heartbeat value it last saw and when (monotonic) that value first appeared."""

    def __init__(self, window: timedelta, last_call: timedelta = timedelta(seconds=1),
                 monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], datetime] = _utc_now) -> None:
        self.window, self.last_call = window, last_call
        self._monotonic, self._wall = monotonic, wall
        self._seen: dict[str, tuple[datetime, float]] = {}  # node -> (its value, monotonic when first seen)
        self._shown: dict[str, tuple[datetime, datetime]] = {}  # node -> (value shown to torch, its real value)
        self._deadline: tuple[datetime, float] | None = None  # (value, monotonic when first seen)
        self._shown_deadline: tuple[datetime, datetime] | None = None
        self._last_read: float | None = None

    def age(self, name: str) -> float:
        """Seconds since `name`'s heartbeat value last changed, on our monotonic clock, as of the last read
        (0 for a node not seen yet: no evidence)."""
        seen = self._seen.get(name)
        return 0.0 if seen is None else self._monotonic() - seen[1]

    def age_of(self, name: str, value: datetime) -> float:
        """`age(name)` if its heartbeat is still `value`; 0 if it changed since the last read (it just beat)."""
        seen = self._seen.get(name)
        return self.age(name) if seen is not None and seen[0] == value else 0.0

    def present(self, state: Any) -> bool:
        """Rewrite `state`'s heartbeats (node -> datetime) and deadline into this agent's clock; True if changed."""
        now, wall = self._monotonic(), self._wall()
        if self._last_read is not None and now - self._last_read > self.window.total_seconds():
            self._seen = {name: (value, now) for name, (value, _) in self._seen.items()}
        self._last_read = now
        names = {str(node): node for node in state.last_heartbeats}
        self._seen = {n: seen for n, seen in self._seen.items() if n in names}
        self._shown.clear()
        changed = False
        for name, node in names.items():
            value = state.last_heartbeats[node]
            if value == LONG_AGO:  # judged dead by a probe: shown as is
                continue
            if name not in self._seen or self._seen[name][0] != value:
                age = (wall - value).total_seconds()
                stale = name not in self._seen and age > (MAX_SKEW + self.window).total_seconds()
                self._seen[name] = (value, now - age if stale else now)
            shown = wall - timedelta(seconds=now - self._seen[name][1])
            self._shown[name] = (shown, value)
            state.last_heartbeats[node] = shown
            changed = True
        return self._present_deadline(state, now, wall) or changed

    def _present_deadline(self, state: Any, now: float, wall: datetime) -> bool:
        value = state.deadline
        self._shown_deadline = None
        if value is None or value == LONG_AGO:
            self._deadline = None
            return False
        if self._deadline is None or self._deadline[0] != value:
            self._deadline = (value, now)
        shown = wall - timedelta(seconds=now - self._deadline[1]) + self.last_call
        self._shown_deadline, state.deadline = (shown, value), shown
        return True

    def restore(self, state: Any) -> None:
        """Put back the real values of everything in `state` that torch left as `present` showed it."""
        for node, value in state.last_heartbeats.items():
            shown = self._shown.get(str(node))
            if shown is not None and shown[0] == value:
                state.last_heartbeats[node] = shown[1]
        if self._shown_deadline is not None and state.deadline == self._shown_deadline[0]:
            state.deadline = self._shown_deadline[1]
