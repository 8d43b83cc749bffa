"""What a signal asks of a worker (worker/stop.py), with real signals sent to this process."""

import os
import signal
import time

import pytest

from elastic_mnist.worker import stop as stop_signals
from elastic_mnist.worker.stop import StopRequest

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _handlers_restored():
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    stop_signals._EARLY = None


def _send(sig: int) -> None:
    os.kill(os.getpid(), sig)  # the handler runs in this (main) thread before kill() returns to Python code


def test_a_repeated_sigterm_is_the_same_request_not_death():
    stop = StopRequest()
    stop.install()
    for _ in range(3):  # a node-wide SIGTERM, the agent's forward, a kubelet's retry
        _send(signal.SIGTERM)
    assert stop.requested and stop.signum == signal.SIGTERM and stop.received == 3
    assert signal.getsignal(signal.SIGTERM) == stop._handle, "still caught: a repeat cannot kill the stop"


def test_a_second_sigint_is_not_caught():
    stop = StopRequest()
    stop.install()
    _send(signal.SIGINT)
    assert stop.requested and signal.getsignal(signal.SIGINT) == signal.SIG_DFL


def test_the_agent_dying_during_a_stop_still_bounds_the_orphan():
    stop = StopRequest(orphan_grace_s=3600)
    stop.install()
    _send(signal.SIGTERM)
    assert not stop.orphaned and stop._timer is None
    _send(signal.SIGHUP)
    assert stop.orphaned and stop._timer is not None
    stop._timer.cancel()
    _send(signal.SIGTERM)
    assert stop.orphaned, "a SIGTERM after the agent died keeps the orphan's reason"


def test_a_sighup_before_the_flags_are_read_gets_its_bound_when_they_are():
    stop = StopRequest()
    stop.install()
    _send(signal.SIGHUP)
    assert stop.orphaned and stop._timer is None
    stop.set_orphan_grace(3600)
    assert stop._timer is not None
    stop._timer.cancel()


def test_the_early_handler_is_handed_on():
    """A stop during the imports ends the process at once (tests/test_train_process.py sends one); the
    handler handed on leaves that to the worker's run, which sets it again until the group forms."""
    stop_signals.install_early()
    stop = stop_signals.for_process()
    assert signal.getsignal(signal.SIGTERM) == stop._handle and not stop.at_once
    _send(signal.SIGTERM)
    assert stop.requested
    fresh = stop_signals.for_process()  # another worker run in the same process
    assert fresh is not stop and not fresh.requested


_COUNTER = """
import signal, sys
count = 0
def counted(*_):
    global count
    count += 1
    print("term", flush=True)
signal.signal(signal.SIGTERM, counted)
print("ready", flush=True)
sys.stdin.read()
print(count, flush=True)
"""


def test_the_pod_passes_only_the_first_sigterm_on_to_torchrun():
    """A VM shutting down signals the pod's PID 1 and torchrun at once: our forward must not be a second
    SIGTERM to the agent (each one raises in it and cuts short its wait for the workers' save)."""
    import subprocess
    import sys

    from elastic_mnist.ops.pod import Forwarder

    child = subprocess.Popen([sys.executable, "-c", _COUNTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    forwarder = None
    try:
        assert child.stdout.readline() == "ready\n"
        forwarder = Forwarder(stop_s=3600)
        forwarder.started, forwarder.child = True, child.pid  # torchrun runs: a signal is passed on, not our end
        _send(signal.SIGTERM)
        assert child.stdout.readline() == "term\n"  # handled: a second one cannot merge with it
        _send(signal.SIGTERM)
        out, _ = child.communicate("", timeout=30)  # stdin closed after both signals were sent
    finally:
        child.kill()
        if forwarder and forwarder.timer:
            forwarder.timer.cancel()  # its stop deadline would kill this process's children
    assert forwarder.received == signal.SIGTERM and out == "1\n", "one SIGTERM reached torchrun"


def test_a_stop_for_the_agents_next_round_is_told_from_the_nodes_end(tmp_path, monkeypatch):
    from elastic_mnist import agent_link
    from elastic_mnist.contract.env import AGENT_DIR_ENV

    monkeypatch.setenv(AGENT_DIR_ENV, str(tmp_path))
    stop = StopRequest()
    stop.install()
    assert stop.snapshot() == (False, False, 0.0)
    _send(signal.SIGTERM)  # the node's own stop: no note from its agent
    requested, node_ends, since = stop.snapshot()
    assert requested and node_ends and 0 < since <= time.monotonic()
    stop.spent()
    agent_link.mark_stopping(str(tmp_path), True)  # the agent restarts its workers for a join
    _send(signal.SIGTERM)
    assert stop.snapshot()[:2] == (True, False) and stop.for_round
    stop.spent()
    assert not stop.for_round and stop.snapshot()[0] is False
    _send(signal.SIGHUP)  # the agent died: not a stop the ranks wait on either
    assert stop.orphaned and stop.snapshot()[:2] == (True, False)


@pytest.mark.parametrize("sums, world, expected", [
    ((0, 0, 0), 3, ""),  # nobody stops
    ((1, 0, 0), 3, "leave"),  # a join or an agent gone (or a rank that saves alone): at once
    ((3, 2, 0), 3, "leave"),  # one rank's stop is its agent's round change: at once
    ((2, 2, 0), 3, ""),  # two of three nodes end: wait for the third
    ((2, 2, 1), 3, "leave"),  # ... for --stop-wait at most: then they leave, the third resumes from memory
    ((3, 3, 0), 3, "save"),  # every node ends: all save together
    ((3, 3, 3), 3, "save"),
])
def test_the_ranks_leave_at_once_wait_or_save_together(sums, world, expected):
    assert stop_signals.verdict(*sums, world) == expected
