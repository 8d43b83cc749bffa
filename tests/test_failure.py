"""The peer-loss handoff always ends: exactly one thread saves the last completed step, and the process
ends with RESTART after a save, SAVE_FAILED when the save raises or hangs, within the bound.

In one process with a fake save, a fake control plane and an exit that records its code instead of
dying: this is thread and timing logic, which real workers (tests/e2e/test_peer_loss.py) cannot drive
into the rare orders. The threads meet on events and barriers, never on sleeps.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from elastic_mnist.contract import exit_codes
from elastic_mnist.worker.failure import Bounds, FailureHandoff, Handled

WAIT_S = 10.0  # how long a test waits for anything at all: far above every bound below
SLACK_S = 3.0  # what a loaded CI machine may add to a bound


class Exit:
    """Records each code the handoff ends the process with."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


class Control:
    """The control plane as the handoff sees it: a heartbeat that confirms (or not) a peer's loss."""

    def __init__(self, lost: bool = True) -> None:
        self.lost = threading.Event()
        if lost:
            self.lost.set()

    def confirms_peer_loss(self, timeout_s: float) -> bool:
        return self.lost.wait(timeout_s)


class Save:
    """A failure save: counts its calls and their owners; `during` runs inside it; it may raise or block."""

    def __init__(self, raises: type[BaseException] | None = None, blocks: bool = False, during=None) -> None:
        self.owners: list[str] = []
        self.raises, self.during = raises, during
        self.release = threading.Event()
        if not blocks:
            self.release.set()

    def __call__(self, owner: str) -> str:
        self.owners.append(owner)
        if self.during is not None:
            self.during()
        if self.raises is not None:
            raise self.raises("disk full")
        assert self.release.wait(WAIT_S)
        return f"saved by {owner}"


def _handoff(save: Save, exit: Exit, control: Control | None = None, takeover_s: float = 0.2,
             end_s: float = 1.0) -> FailureHandoff:
    return FailureHandoff(save, control or Control(), Bounds(confirm_s=0.2, takeover_s=takeover_s, end_s=end_s),
                          warn=lambda msg: None, exit=exit)


def _thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def _ended(exit: Exit, t0: float, bound_s: float) -> list[int]:
    assert exit.called.wait(WAIT_S), "the process never ended"
    assert time.monotonic() - t0 < bound_s + SLACK_S
    return exit.codes


def test_loss_seen_first_by_the_data_collective_main_saves_and_the_watch_stands_by():
    exit, watch_alive = Exit(), []

    def heartbeat_fails_too():  # while the main thread saves: the watch must stand by at once
        watch = _thread(handoff.peer_lost)
        watch.join(WAIT_S)
        watch_alive.append(watch.is_alive())

    save = Save(during=heartbeat_fails_too)
    handoff = _handoff(save, exit, takeover_s=WAIT_S, end_s=0.3)
    t0 = time.monotonic()
    assert handoff.main_failed(dist.DistError("peer reset")) == Handled(in_place=False, saved="saved by main")
    assert time.monotonic() - t0 < SLACK_S, "the watch did not wait out its takeover grace"
    assert watch_alive == [False] and save.owners == ["main"]
    assert exit.codes == [], "the main thread returns; the worker exits 75 itself"
    # Whatever then keeps the worker from exiting, the watchdog ends it, as saved.
    assert _ended(exit, t0, 0.3) == [exit_codes.RESTART]
    assert save.owners == ["main"]


def test_loss_seen_first_by_the_heartbeat_the_watch_saves_and_main_stands_by():
    exit, main_result = Exit(), []
    # The main thread's collective raises while the watch is saving: it must wait, not save again.
    main = threading.Thread(target=lambda: main_result.append(handoff.main_failed(RuntimeError("gloo timeout"))))
    save = Save(during=main.start)
    handoff = _handoff(save, exit)
    t0 = time.monotonic()
    handoff.peer_lost()
    assert _ended(exit, t0, 0.2) == [exit_codes.RESTART]
    main.join(WAIT_S)
    assert not main.is_alive() and main_result == [None]
    assert save.owners == ["watch"] and exit.codes == [exit_codes.RESTART]


def test_an_error_that_is_not_a_peers_loss_is_not_saved():
    exit, save = Exit(), Save()
    handoff = _handoff(save, exit, control=Control(lost=False))
    assert handoff.main_failed(ValueError("a bug")) is None
    assert save.owners == [] and exit.codes == []


@pytest.mark.parametrize("error", [OSError, SystemExit], ids=["raises", "kills-its-thread"])
@pytest.mark.parametrize("owner", ["main", "watch"])
def test_a_save_that_raises_ends_the_process_with_save_failed(owner, error):
    exit, save = Exit(), Save(raises=error)
    handoff = _handoff(save, exit, end_s=WAIT_S)
    t0 = time.monotonic()
    if owner == "main":
        assert handoff.main_failed(dist.DistError("peer reset")) is None
    else:
        handoff.peer_lost()
    # At once, not at the watchdog's bound.
    assert _ended(exit, t0, 0.2) == [exit_codes.SAVE_FAILED]
    assert save.owners == [owner]


@pytest.mark.parametrize("owner", ["main", "watch"])
def test_a_save_that_blocks_ends_the_process_within_the_bound(owner):
    exit, save = Exit(), Save(blocks=True)
    handoff = _handoff(save, exit, end_s=0.5)
    t0 = time.monotonic()
    if owner == "main":
        thread = _thread(handoff.main_failed, dist.DistError("peer reset"))
    else:
        thread = _thread(handoff.peer_lost)
    assert _ended(exit, t0, 0.5) == [exit_codes.SAVE_FAILED]
    assert time.monotonic() - t0 >= 0.5, "the watchdog gave the save its whole bound"
    save.release.set()  # the filesystem comes back: too late, the code stays
    thread.join(WAIT_S)
    assert exit.codes == [exit_codes.SAVE_FAILED] and save.owners == [owner]


def test_both_threads_failing_at_once_run_exactly_one_save():
    for _ in range(10):
        exit, save = Exit(), Save()
        # No grace for the main thread: the watch claims the save the moment it sees the loss.
        handoff = _handoff(save, exit, takeover_s=0.0, end_s=0.1)
        start = threading.Barrier(2)
        t0 = time.monotonic()
        main = _thread(lambda: (start.wait(), handoff.main_failed(dist.DistError("peer reset"))))
        watch = _thread(lambda: (start.wait(), handoff.peer_lost()))
        assert _ended(exit, t0, 0.1) == [exit_codes.RESTART]
        for thread in (main, watch):
            thread.join(WAIT_S)
            assert not thread.is_alive()
        assert len(save.owners) == 1 and exit.codes == [exit_codes.RESTART]


def test_with_rounds_in_place_the_loss_ends_the_round_in_memory_with_no_save_and_no_exit():
    exit, save, unblocked = Exit(), Save(), threading.Event()
    handoff = FailureHandoff(save, Control(), Bounds(confirm_s=0.2, end_s=0.3, in_place_s=WAIT_S), warn=lambda m: None,
                             exit=exit, unblock=unblocked.set)
    watch = _thread(handoff.peer_lost)  # the heartbeat sees it first: it unblocks the main thread's collective
    assert unblocked.wait(WAIT_S)
    assert handoff.main_failed(dist.DistError("peer reset")) == Handled(in_place=True)
    watch.join(WAIT_S)
    assert not watch.is_alive() and save.owners == []
    # past end_s: the watchdog the watch thread armed was disarmed by the main thread, and nothing ends the process
    assert not exit.called.wait(0.3 + 0.5) and exit.codes == []
