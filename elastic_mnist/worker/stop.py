"""What a signal asks of a worker: stop with the group at the next step boundary and save that step.

    torchrun ... -m elastic_mnist.train ...      # `kill -TERM <agent>` or `kill -TERM -<pgid>`: a graceful stop

No torch here: `python -m elastic_mnist.train` installs the handlers from this module before torch loads
(`install_early`, a few hundred ms after exec instead of seconds), so a SIGTERM during start-up is a
graceful stop too, not the default action that kills the process.

One SIGTERM or many is the same request. A node can get it more than once at the same moment: a VM
shutting down signals every process, and torchrun's agent, signalled too, forwards its own SIGTERM to the
worker's process group (and the fork()ed DataLoader workers inherit this handler). Honouring a repeat with
the default action would kill the worker in the middle of the stop it was asked for; what bounds a stop
that hangs is the agent's SIGKILL after its --shutdown-timeout (or the kubelet's after its grace period).
A second SIGINT does end the process: the way out for a person at a terminal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

from elastic_mnist import agent_link
from elastic_mnist.contract import exit_codes
from elastic_mnist.worker.phase import Phase


class StopRequest:
    """SIGTERM (a spot preemption notice, or torchrun stopping us for a membership change) or SIGHUP
    (our torchrun agent died: the parent-death signal) asks the whole group to checkpoint at the next
    step boundary and leave; a repeated SIGTERM is the same request (module docstring), a second SIGINT
    is not caught.

    Without an agent nobody supervises this worker, so after `orphan_grace_s` it exits however far the
    agreement got: a worker never trains on alone."""

    def __init__(self, orphan_grace_s: float = 0.0) -> None:
        self.signum: int | None = None
        self.since = 0.0
        """When the stop came (monotonic)."""
        self.for_round = False
        """The agent stops this worker for its next round (a join): the node goes on."""
        self.orphan_grace_s = orphan_grace_s
        self.received = 0
        """How many stop signals arrived (a repeat changes nothing else)."""
        self._timer: threading.Timer | None = None
        self.at_once: str = ""
        """While set (what the worker is doing), a stop ends the process at once: nothing is loaded yet."""
        self._before: Callable[[], str] | None = None
        self.early = False
        """Installed before the imports (`install_early`), not yet taken by the worker (`for_process`)."""
        self.phase: Callable[[], Phase] = lambda: Phase.TRAINING
        """The worker's phase, as its life holds it (worker/phase.py)."""

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.received += 1
        if signum != signal.SIGHUP and self.phase() is Phase.BETWEEN_ROUNDS:
            return  # a kept worker between rounds: its last round's stand-in passing on the end of that round
        if self.at_once and signum in _LEAVE_ON:
            _exit_now(self.at_once, self._before)
        if signum == signal.SIGHUP and self.orphaned:
            return  # the kernel may deliver the parent-death signal more than once; the timer bounds us
        if signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C ends the process
        if signum != signal.SIGHUP and self.signum is not None:
            return  # already stopping (SIGTERM again, or after SIGHUP): keep the first reason and its timer
        # signum last: a snapshot that sees it sees the rest of this request
        self.since, self.for_round = time.monotonic(), signum != signal.SIGHUP and agent_link.stopping_for_round()
        self.signum = signum
        if signum == signal.SIGHUP:
            self._start_orphan_timer()

    def set_orphan_grace(self, seconds: float) -> None:
        """The bound an orphaned worker gets (known once the flags are read, after a signal may have come)."""
        self.orphan_grace_s = seconds
        if self.orphaned:
            self._start_orphan_timer()

    def _start_orphan_timer(self) -> None:
        if self._timer is not None or not self.orphan_grace_s:
            return
        self._timer = threading.Timer(self.orphan_grace_s, os._exit, args=(exit_codes.UNSUPERVISED,))
        self._timer.daemon = True
        self._timer.start()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def orphaned(self) -> bool:
        return self.signum == signal.SIGHUP

    def snapshot(self) -> tuple[bool, bool, float]:
        """(requested, the node itself ends, since when), read at once: a stop of this node itself (a
        preemption, the job's end), not its agent's round change (a join) nor its agent's death."""
        signum = self.signum
        if signum is None:
            return False, False, 0.0
        return True, signum != signal.SIGHUP and not self.for_round, self.since

    def spent(self) -> None:
        """The stop that ended a round is spent: a worker kept for the next round waits for another (a stop
        signal before that round is about the round that ended: Phase.BETWEEN_ROUNDS)."""
        if not self.orphaned:
            self.signum, self.for_round = None, False

    @contextmanager
    def leave_at_once(self, what: str, before: Callable[[], str] | None = None):
        """While the block runs this worker holds nothing new to save (no state loaded this round: the newest
        is in its files, its peers, or the /dev/shm snapshots for the node's next worker), so a stop signal
        ends the process at once, exit 0, after `before()` (a kept worker saves what an earlier round left
        it). Python runs a signal handler only between bytecodes, never inside the C++ call that forms the
        process group, which waits up to --connect-timeout for peers that may be leaving; the interpreter's
        wakeup fd is written from the C handler itself, so a thread sees it there."""
        if self.requested:
            _exit_now(what, before)
        if threading.current_thread() is not threading.main_thread():
            yield  # set_wakeup_fd is the main thread's (a worker run inside a test's thread)
            return
        self.at_once, self._before = what, before  # the handler, between bytecodes (the start-up cost's sleep)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd)
        done = threading.Event()
        threading.Thread(target=_watch, args=(read_fd, done, what, before), daemon=True, name="stop-watch").start()
        try:
            if self.requested:  # came before the wakeup fd was in place
                _exit_now(what, before)
            yield
        finally:
            self.at_once, self._before = "", None
            done.set()
            signal.set_wakeup_fd(previous)
            os.write(write_fd, b"\0")  # wakes the watcher, which closes the read end
            os.close(write_fd)
        if self.requested:  # it came as the block ended
            _exit_now(what, before)


_LEAVE_ON = {signal.SIGTERM, signal.SIGHUP, signal.SIGINT}


def verdict(stops: float, node_ends: float, waited_out: float, world: int) -> str:
    """What the ranks agree on at a step, from the sums of their stop requests: "" trains on, "leave", or
    "save": every rank's node ends, so they save together before leaving. `node_ends` counts only the ranks
    that cannot save alone (a sharded round kept in place); each of those trains on, for at most its
    --stop-wait (`waited_out`), to see whether the whole job is stopping. Any other stop leaves at once."""
    if not stops:
        return ""
    if stops > node_ends:
        return "leave"
    if node_ends >= world:
        return "save"
    return "leave" if waited_out else ""


def _watch(read_fd: int, done: threading.Event, what: str, before: Callable[[], str] | None) -> None:
    try:
        while not done.is_set():
            data = os.read(read_fd, 64)
            if not done.is_set() and _LEAVE_ON & set(data):
                _exit_now(what, before)
    finally:
        os.close(read_fd)


def _exit_now(what: str, before: Callable[[], str] | None = None) -> None:
    saved = ""
    try:
        saved = before() if before is not None else ""
    except Exception as e:  # noqa: BLE001 - the exit must happen; the newest state is still with the peers
        saved = f"not saved: {type(e).__name__}: {e}"
    try:  # (from a signal handler the stream may be mid-write: the exit matters, not the line)
        held = f"state saved ({saved})" if saved else "nothing loaded, nothing to save"
        print(f"elastic-mnist train: stop requested {what}: {held}; exiting now", file=sys.stderr, flush=True)
        sys.stdout.flush()
    except (OSError, RuntimeError, ValueError):
        pass
    os._exit(exit_codes.OK)


def install_early() -> None:
    """Install a StopRequest now (main thread, before the slow imports); `for_process` hands it on. The
    signal table holds it meanwhile: no module state."""
    if _installed_early() is None:
        stop = StopRequest()
        stop.early, stop.at_once = True, "during start-up"  # importing torch, reading flags: need not wait
        stop.install()


def _installed_early() -> StopRequest | None:
    stop = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    return stop if isinstance(stop, StopRequest) and stop.early else None


def for_process() -> StopRequest:
    """The worker's StopRequest, installed: the early one with whatever it caught, else a new one. Taken
    once: a second worker run in the same process (tests) starts from no request."""
    stop = _installed_early()
    if stop is not None:
        stop.early = False
        stop.at_once = ""  # a worker run in-process (tests) leaves at its step boundary; run() sets its own
    if stop is None:
        stop = StopRequest()
        stop.install()
    return stop
