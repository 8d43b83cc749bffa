"""What a signal asks of a worker (worker/stop.py), with real signals sent to this process."""

import os
import signal

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


def test_the_early_handler_is_handed_on_with_what_it_caught():
    stop_signals.install_early()
    _send(signal.SIGTERM)  # during the imports
    stop = stop_signals.for_process()
    assert stop.requested and signal.getsignal(signal.SIGTERM) == stop._handle
    fresh = stop_signals.for_process()  # another worker run in the same process
    assert fresh is not stop and not fresh.requested
