"""The agent's side of the restart budget (rendezvous/_budget.py): which restarts are this node's own, how
their rate is limited, and when the rendezvous is closed. torch's agent calls these three methods; a small
stand-in for its handler records what reaches torch's. The worker's side runs in real processes in
tests/e2e/test_restart_budget.py.

    python -m pytest -q tests/test_restart_budget.py
"""

from __future__ import annotations

import pytest

from elastic_mnist import agent_link
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.env import AGENT_DIR_ENV, AGENT_PID_ENV
from elastic_mnist.rendezvous._budget import RestartBudget


class Handler:
    """What torch's handler would answer: `waiting` nodes; counts its rendezvous and shutdowns."""

    def __init__(self) -> None:
        self.waiting, self.joined, self.closed = 0, 0, 0

    def next_rendezvous(self):
        self.joined += 1
        return "round"

    def num_nodes_waiting(self) -> int:
        return self.waiting

    def shutdown(self) -> bool:
        self.closed += 1
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _budget(tmp_path, limit=2, window_s=60.0):
    handler, clock, left = Handler(), Clock(), []
    budget = RestartBudget(handler, str(tmp_path), limit, window_s, lambda: left.append(True), clock)
    return budget, handler, clock, left


def _worker_round_over(tmp_path) -> None:
    (tmp_path / agent_link.ROUND_OVER).write_text("")


def test_a_workers_round_over_note_is_a_waiting_node_taken_once(tmp_path):
    budget, handler, _, _ = _budget(tmp_path)
    assert budget.num_nodes_waiting() == 0
    _worker_round_over(tmp_path)
    assert budget.num_nodes_waiting() == 1  # torch restarts a healthy group for this, uncounted
    assert not (tmp_path / agent_link.ROUND_OVER).exists(), "taken: the waiting worker may exit"
    assert budget.num_nodes_waiting() == 0


def test_membership_changes_never_count_and_own_crashes_are_limited_by_rate(tmp_path):
    budget, handler, clock, _ = _budget(tmp_path, limit=2, window_s=60)
    budget.next_rendezvous()  # the first round: no restart
    for _ in range(50):  # peers leaving and joining, every way the agent learns of it
        handler.waiting = 1
        assert budget.num_nodes_waiting() == 1
        handler.waiting = 0
        budget.next_rendezvous()
        _worker_round_over(tmp_path)
        budget.num_nodes_waiting()
        budget.next_rendezvous()
    assert list(budget.crashes) == []
    budget.next_rendezvous()  # own crash 1 (torch saw a failed worker: no waiting node was reported)
    clock.now += 30
    budget.next_rendezvous()  # own crash 2
    clock.now += 31  # the first is out of the window now
    budget.next_rendezvous()
    assert len(budget.crashes) == 2
    with pytest.raises(SystemExit) as ended:
        budget.next_rendezvous()  # a third within 60 s
    assert ended.value.code == exit_codes.NODE_LOCAL
    assert handler.joined == 1 + 100 + 3, "the one that gave up did not join again"


def test_a_configuration_error_is_left_to_the_verdict_not_counted(tmp_path):
    budget, _, _, _ = _budget(tmp_path, limit=1)
    budget.next_rendezvous()
    (tmp_path / agent_link.CONFIG_ERROR).write_text("bad flag\n")
    for _ in range(3):
        budget.next_rendezvous()
    assert list(budget.crashes) == []


def test_only_a_node_whose_agent_ends_well_closes_the_rendezvous(tmp_path):
    """torch's launcher calls shutdown in a `finally`: on the way out of an error (workers failed past
    --max-restarts, this node gave up) the node leaves; its workers' success closes the finished job."""
    budget, handler, _, left = _budget(tmp_path)
    for error in (RuntimeError("ChildFailedError"), SystemExit(exit_codes.NODE_LOCAL)):
        try:
            raise error
        except BaseException:  # noqa: BLE001 - as in a finally clause, with the exception on its way out
            assert budget.shutdown()
    assert handler.closed == 0 and left == [True, True]
    assert budget.shutdown() and handler.closed == 1


def test_a_stale_note_does_not_restart_the_next_round(tmp_path):
    budget, _, _, _ = _budget(tmp_path)
    budget.next_rendezvous()
    _worker_round_over(tmp_path)  # written by a worker stopped before its agent looked
    budget.next_rendezvous()  # (a crash of its own, counted)
    assert budget.num_nodes_waiting() == 0


def _child_ending(tmp_path, code: int, stopped: bool = False):
    import os
    import subprocess
    import sys

    from elastic_mnist import procs

    env = procs.child_env(**{AGENT_DIR_ENV: str(tmp_path), AGENT_PID_ENV: str(os.getpid())})
    program = f"from elastic_mnist import agent_link; agent_link.end_process({code}, stopped={stopped})"
    return subprocess.Popen([sys.executable, "-c", program], env=env)


def test_a_worker_ending_its_round_waits_for_its_agent_to_take_the_note(tmp_path):
    """A real process this one started (its agent, as far as it knows) exits 75 only once the note is taken."""
    from elastic_mnist import procs

    child = _child_ending(tmp_path, exit_codes.RESTART)
    note = tmp_path / agent_link.ROUND_OVER
    procs.wait_for(note.exists, 30, "the round-over note")
    assert child.poll() is None, "it waits for its agent"
    assert agent_link.take_round_over(str(tmp_path))
    assert child.wait(timeout=10) == exit_codes.RESTART


def test_any_other_end_leaves_no_note(tmp_path):
    for code in (exit_codes.OK, exit_codes.PERMANENT, exit_codes.SAVE_FAILED):
        assert _child_ending(tmp_path, code).wait(timeout=30) == code
    assert not (tmp_path / agent_link.ROUND_OVER).exists()


def test_a_worker_ending_while_its_agent_stops_it_does_not_wait(tmp_path):
    """The agent decided on a new round for another reason (a peer's loss it saw itself): it is about to stop
    its workers and will take no note, so a round that ends now ends the process at once."""
    budget, handler, _, _ = _budget(tmp_path)
    handler.waiting = 1
    assert budget.num_nodes_waiting() == 1
    assert _child_ending(tmp_path, exit_codes.RESTART).wait(timeout=10) == exit_codes.RESTART
    assert not (tmp_path / agent_link.ROUND_OVER).exists()
    budget.next_rendezvous()
    assert not (tmp_path / agent_link.STOPPING).exists(), "the next round's workers wait for their agent again"


def test_a_worker_already_told_to_stop_does_not_wait(tmp_path):
    """Its agent stops its workers without asking for waiting nodes (another local worker failed, or the node
    ends): the stop signal came first, so the round's end is the process's end at once."""
    assert _child_ending(tmp_path, exit_codes.RESTART, stopped=True).wait(timeout=10) == exit_codes.RESTART
    assert not (tmp_path / agent_link.ROUND_OVER).exists()
