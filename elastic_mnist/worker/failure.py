"""What a rank does when a peer is lost: one owner saves the last completed step, and the process ends
within a bound whatever happens to that save.

    torchrun ... -m elastic_mnist.train --collective-timeout 60   # a lost peer ends a worker within 90 s

Two threads learn of the loss: the main thread when a collective raises, the peer-watch thread when the
heartbeat fails (control.py). Whichever sees it first owns the save; the main thread wins if it fails
within `takeover_s` of the heartbeat. The other
thread stands by. torchrun's agent only watches exit codes, so a watchdog started at the first sign of
the loss ends the process at `end_s` in any case: RESTART when the state was saved, SAVE_FAILED when
the save raised, hung (a stuck filesystem) or its thread died.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from elastic_mnist import agent_link
from elastic_mnist.contract import exit_codes
from elastic_mnist.distributed import RoundAbandoned
from elastic_mnist.runlog import say

# What a failure save may take beyond --collective-timeout before the watchdog gives up on it: the same
# allowance an orphaned worker gets (stop.StopRequest). A healthy save of the last step takes well
# under this; the bound exists so that nothing can keep a worker torchrun waits for alive.
SAVE_GRACE_S = 30.0


class LossWitness(Protocol):
    def confirms_peer_loss(self, timeout_s: float) -> bool: ...


@dataclass(frozen=True)
class Bounds:
    confirm_s: float
    """How long the main thread asks the heartbeat whether its collective's error is a peer's loss."""
    end_s: float
    """From the first sign of the loss to the end of the process, saved or not."""
    in_place_s: float = 5.0
    """With rounds in place: how long the watch thread leaves the main thread to come out of its collective
    (abandon_round ends any interruptible wait at once) and end the round in memory, before it saves and ends
    the process instead (the main thread is stuck where nothing interrupts it: DDP's backward, a device)."""
    takeover_s: float = 0.25
    """How long the watch thread leaves the main thread to take the save over. Only who saves depends on
    it: the save and the optimizer step share the trainer's state lock, so either saves a consistent step.
    A killed peer fails both threads within milliseconds (a reset); a vanished one never fails the main
    thread's collective, and every second waited here is a second of the recovery."""

    @classmethod
    def of(cls, config) -> Bounds:
        return cls(confirm_s=config.peer_timeout + 2, end_s=config.collective_timeout + SAVE_GRACE_S)


@dataclass(frozen=True)
class Handled:
    """How this rank's round ended on a peer's loss (main_failed's answer when it was one)."""

    in_place: bool
    """the round ends in memory: nothing saved, no exit; this process goes on to the next round"""
    saved: str = ""
    """where the last completed step was saved (the process then exits for torchrun to restart)"""


IN_PLACE = Handled(in_place=True)
_MAIN, _WATCH, _KEPT = "main", "watch", "kept"  # who owns the loss (the handoff's claim)


class FailureHandoff:
    """The one place both threads meet on a peer's loss. `save(owner)` ("main" or "watch") saves the last
    completed step and says where; `exit` ends the process (injectable: tests observe the code). With
    `unblock` (rounds in place: distributed.abandon_round) the main thread ends the round in memory instead."""

    def __init__(self, save: Callable[[str], str], witness: LossWitness, bounds: Bounds, warn: Callable[[str], None],
                 abort: Callable[[], None] | None = None, exit: Callable[[int], None] = agent_link.end_process,
                 unblock: Callable[[], None] | None = None):
        self._save, self._witness, self.bounds, self._warn, self._abort = save, witness, bounds, warn, abort
        self._exit, self._unblock = exit, unblock
        self._lock = threading.Lock()
        self._owner: str | None = None
        self._deadline: float | None = None
        self._watchdog: threading.Timer | None = None
        self._main_failing = threading.Event()
        self._saved = threading.Event()
        self._ended = threading.Event()
        self._exited = threading.Event()  # set only when an injected exit returns
        self.exit_code: int | None = None

    # -- the two threads ---------------------------------------------------------------------------
    def main_failed(self, error: BaseException) -> Handled | None:
        """Main thread, a collective raised: the round ended in memory, or where the last completed step was
        saved; None when the error is not a peer's loss (a bug: the caller re-raises). Does not return when
        the watch thread owns the save: that one ends the process (or the watchdog does)."""
        self._main_failing.set()  # from here on the watch thread stands by
        if not (isinstance(error, (dist.DistError, RoundAbandoned)) or
                self._witness.confirms_peer_loss(self.bounds.confirm_s)):
            return None
        if self._unblock is not None and self._claim(_KEPT):
            self._disarm()
            return IN_PLACE
        self._arm()
        if not self._claim(_MAIN):
            self._stand_by()
            return None  # reached only with an injected exit that returns
        where = self._run_save(_MAIN)
        return None if where is None else Handled(in_place=False, saved=where)

    def peer_lost(self) -> None:
        """Peer-watch thread, the heartbeat failed: abort the data group where that unblocks it (NCCL),
        then save and end the process unless the main thread takes over in time."""
        self._arm()  # first: an abort can hang too
        if self._abort is not None:
            self._abort()
        if self._unblock is not None:
            self._unblock()
            if self._main_failing.wait(self.bounds.in_place_s):
                return  # the main thread ends the round in memory
        if self._main_failing.wait(self.bounds.takeover_s) or not self._claim(_WATCH):
            return  # the main thread owns the save; the watchdog bounds it
        if self._run_save(_WATCH) is not None:
            self._end(exit_codes.RESTART)

    # -- the parts ---------------------------------------------------------------------------------
    def _claim(self, owner: str) -> bool:
        with self._lock:
            if self._owner is None:
                self._owner = owner
            return self._owner == owner

    def _run_save(self, owner: str) -> str | None:
        try:
            where = self._save(owner)
        except BaseException as e:  # noqa: BLE001 - whatever stops the save, the process must still end
            with suppress(Exception):  # the journal may sit on the filesystem that just failed
                self._warn(f"saving the last completed step failed ({type(e).__name__}: {e}); exiting "
                           f"{exit_codes.SAVE_FAILED} for torchrun to restart from the newest earlier state")
            self._end(exit_codes.SAVE_FAILED)
            return None
        self._saved.set()
        return where

    def _arm(self) -> None:
        """Start the watchdog once, at the first sign of the loss on either thread."""
        with self._lock:
            if self._watchdog is not None or self._owner == _KEPT:
                return
            self._deadline = time.monotonic() + self.bounds.end_s
            self._watchdog = threading.Timer(self.bounds.end_s, self._expire)
            self._watchdog.daemon = True
            self._watchdog.name = "failure-watchdog"
            self._watchdog.start()

    def _disarm(self) -> None:
        with self._lock:
            if self._watchdog is not None:
                self._watchdog.cancel()

    def _stand_by(self) -> None:
        """The other thread owns the save: wait for it to end the process, at most until the deadline. Its end
        may itself wait (for the agent to take the round's end: agent_link.end_process), so this thread stays
        here until the process is gone; only an injected exit that returns lets it go on."""
        self._ended.wait(max(0.0, self._deadline - time.monotonic()))
        self._expire()
        self._exited.wait()

    def _expire(self) -> None:
        if self._ended.is_set():
            return
        if not self._saved.is_set():
            # stderr only: the journal's file may be on the filesystem the save hangs in
            with suppress(Exception):
                say(f"the failure save did not finish within {self.bounds.end_s:.0f}s; exiting "
                    f"{exit_codes.SAVE_FAILED} for torchrun to restart from the newest earlier state")
        self._end(exit_codes.RESTART if self._saved.is_set() else exit_codes.SAVE_FAILED)

    def _end(self, code: int) -> None:
        with self._lock:
            if self._ended.is_set():
                return  # the first end wins; the rest is only reachable with an injected exit
            self.exit_code = code
            self._ended.set()
        with suppress(Exception):  # a closed or broken pipe must not keep the process alive
            sys.stdout.flush()
            sys.stderr.flush()
        self._exit(code)
        self._exited.set()
