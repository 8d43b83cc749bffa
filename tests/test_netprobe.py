"""Beacon probes (elastic_mnist/netprobe.py) and the worker's late-heartbeat probe (worker/control.py), on
real sockets on this machine's loopback; a silent host needs a network namespace (tests/test_netns.py).

    python -m pytest -q tests/test_netprobe.py
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import pytest

from elastic_mnist.config import TrainConfig
from elastic_mnist.contract.env import PEER_BEACONS_ENV
from elastic_mnist.distributed import read_env
from elastic_mnist.netprobe import check, split_address, wait_for_listener
from elastic_mnist.rendezvous._liveness import Beacon
from elastic_mnist.worker import control
from elastic_mnist.worker.control import ControlPlane


@contextmanager
def frozen_agent():
    """A port whose kernel completes handshakes while nobody accepts: what a SIGSTOPped agent's beacon is."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_live_agent_and_a_closed_port_are_ok_a_frozen_agent_is_not() -> None:
    live = Beacon("127.0.0.1", lambda: b"1")
    try:
        with frozen_agent() as frozen:
            started = time.monotonic()
            verdicts = check({"live": live.address, "gone": closed_port(), "frozen": frozen}, 0.4)
            took = time.monotonic() - started
    finally:
        live.close()
    # a refusal comes from the host's kernel: the host is up (its agent is gone, which the agents handle)
    assert verdicts == {"live": "ok", "gone": "ok", "frozen": "frozen"}
    assert took < 1.0, "all probed at once, within one timeout"


def test_addresses_must_be_numeric() -> None:
    assert split_address("198.18.0.5:80") == ("198.18.0.5", 80) and split_address("[::1]:9") == ("::1", 9)
    for bad in ("localhost:80", "1.2.3.4", "1.2.3.4:0", "1.2.3.4:x"):
        with pytest.raises(ValueError):
            split_address(bad)
    assert check({"name": "localhost:80"}, 0.1) == {"name": "ok"}, "no probe, no verdict against it"


def test_the_workers_get_the_beacons_from_their_agents_environment() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", PEER_BEACONS_ENV: '{"n1_7_0": "198.18.0.3:4000"}'}
    assert read_env(env).peer_beacons == {"n1_7_0": "198.18.0.3:4000"}
    assert read_env({**env, PEER_BEACONS_ENV: "not json"}).peer_beacons == {}


def test_a_store_client_dials_until_rank_0_listens() -> None:
    """Refused means the host is up and its server not yet: dial again soon (torch's own client waits
    0.3-0.7 s), and give up at the deadline; the round's master address comes from torchrun's environment."""
    env = read_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert env.master == ("127.0.0.1", 29500) and read_env({"RANK": "0", "WORLD_SIZE": "1"}).master is None
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        host, port = server.getsockname()
        started = time.monotonic()
        assert not wait_for_listener(host, port, 0.2)
        assert 0.15 <= time.monotonic() - started < 1.0
        answered: list[bool] = []
        dialer = threading.Thread(target=lambda: answered.append(wait_for_listener(host, port, 30)))
        dialer.start()
        server.listen(1)
        dialer.join(30)
        assert answered == [True]


def late_beat(beacons: dict[str, str], late_for: float) -> tuple[list[str], float]:
    """A ControlPlane whose heartbeat has been on the wire since now (the beat itself is not run): what
    its probe thread reports within `late_for` seconds, and when."""
    plane = ControlPlane(1, TrainConfig(), beacons=beacons)
    reasons, started = [], time.monotonic()
    plane._in_flight_since = started  # noqa: SLF001 - the one thing a stuck heartbeat sets
    thread = threading.Thread(target=plane._probe_late, args=(reasons.append,), daemon=True)  # noqa: SLF001
    thread.start()
    thread.join(late_for)
    plane._leaving.set()  # noqa: SLF001
    thread.join(5)
    return reasons, time.monotonic() - started


def test_a_late_beat_loses_a_frozen_peer_after_two_probes() -> None:
    with frozen_agent() as frozen:
        reasons, took = late_beat({"n1": frozen}, 5.0)
    assert len(reasons) == 1 and "n1 frozen" in reasons[0]
    assert control.SUSPECT_S + 2 * control.PROBE_S <= took < 3.0


def test_a_late_beat_with_peers_that_answer_loses_nobody() -> None:
    live = Beacon("127.0.0.1", lambda: b"1")
    try:
        reasons, _ = late_beat({"n1": live.address, "n2": closed_port()}, 2.0)
    finally:
        live.close()
    assert reasons == [], "a slow heartbeat with answering hosts is load, not a loss"
