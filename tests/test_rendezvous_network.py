"""Liveness that trusts no other host's clock, beacons that come back and say whether their agent reaches
etcd, and an etcd outage ridden out (_clock.py, _liveness.py, _client.py), against real etcd and sockets.

    python -m pytest tests/test_rendezvous_network.py -q          # -m "not slow": the in-process logic
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
from etcd_fixtures import raw_client
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elastic_mnist import procs
from elastic_mnist.etcd.client import EtcdConnectionSpec, EtcdV3Client, EtcdV3Error
from elastic_mnist.etcd.lease import LeaseKeeper
from elastic_mnist.etcd.server import EtcdServer
from elastic_mnist.rendezvous._clock import LONG_AGO, HeartbeatClock
from elastic_mnist.rendezvous._liveness import RECHECK_S, Beacon, PeerLiveness, advertised_host
from elastic_mnist.rendezvous._prompt import RoundView

PREFIX = "/torchelastic/v3"
WINDOW = timedelta(seconds=3)
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


class FakeTime:
    """The observer's two clocks, moved by the test (in-process timing logic only)."""

    def __init__(self) -> None:
        self.mono, self.wall = 1000.0, T0

    def tick(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += timedelta(seconds=seconds)


def state_with(beats: dict[str, datetime], deadline: datetime | None = None) -> _RendezvousState:
    state = _RendezvousState()
    state.round = 1
    for i, (name, beat) in enumerate(beats.items()):
        node = _NodeDesc(name, i, 0)
        state.participants[node], state.last_heartbeats[node] = 0, beat
    state.deadline = deadline
    return state


def ages(clock: HeartbeatClock, now: FakeTime, beats: dict[str, datetime]) -> dict[str, float]:
    """What torch would compute as each node's heartbeat age, from the state `clock` shows it."""
    state = state_with(beats)
    clock.present(state)
    return {node.addr: (now.wall - beat).total_seconds() for node, beat in state.last_heartbeats.items()}


@pytest.fixture
def clock() -> tuple[HeartbeatClock, FakeTime]:
    now = FakeTime()
    return HeartbeatClock(WINDOW, timedelta(seconds=1), lambda: now.mono, lambda: now.wall), now


def test_a_heartbeat_long_dead_when_first_seen_keeps_its_age(clock) -> None:
    """A reused run id's dead node (its last beat minutes old by our clock) is not revived by a fresh window;
    a beat within a minute of our clock is a skewed clock, and starts one."""
    heartbeats, now = clock
    dead, skewed = now.wall - timedelta(seconds=100), now.wall - timedelta(seconds=50)
    assert ages(heartbeats, now, {"dead": dead, "skewed": skewed}) == {"dead": 100.0, "skewed": 0.0}
    now.tick(1)
    assert ages(heartbeats, now, {"dead": dead, "skewed": skewed}) == {"dead": 101.0, "skewed": 1.0}


@pytest.mark.parametrize("skew_s", [-30, 30, -5])
def test_a_heartbeat_is_aged_from_when_it_changed_not_from_its_writers_clock(clock, skew_s: int) -> None:
    heartbeats, now = clock
    beat = now.wall + timedelta(seconds=skew_s)  # the node's own wall clock is off by skew_s
    assert ages(heartbeats, now, {"a": beat}) == {"a": 0.0}, "a new value is a heartbeat written just now"
    now.tick(2)
    assert ages(heartbeats, now, {"a": beat}) == {"a": 2.0}, "the same value ages on our monotonic clock"
    beat += timedelta(seconds=1)
    assert ages(heartbeats, now, {"a": beat}) == {"a": 0.0}, "it beat again"
    for _ in range(7):  # we keep reading (an agent reads every ~0.1 s); it stays silent
        now.tick(0.5)
        age = ages(heartbeats, now, {"a": beat})["a"]
    assert age > WINDOW.total_seconds(), "silent past the window: dead"


def test_nobody_is_judged_for_a_gap_in_our_own_reads(clock) -> None:
    """etcd away (or this process frozen) for minutes: every node gets a fresh window from the next read."""
    heartbeats, now = clock
    beats = {"a": T0, "b": T0 - timedelta(seconds=30)}
    assert ages(heartbeats, now, beats) == {"a": 0.0, "b": 0.0}
    now.tick(300)
    assert ages(heartbeats, now, beats) == {"a": 0.0, "b": 0.0}
    for _ in range(7):
        now.tick(0.5)
        seen = ages(heartbeats, now, beats)
    assert min(seen.values()) > WINDOW.total_seconds(), "then silence counts again"


def test_a_heartbeat_that_changed_in_this_read_is_not_stale(clock) -> None:
    """Staleness is judged before the new read is taken in: a value that changed since the last read just
    beat, however long ago the previous one was seen."""
    heartbeats, now = clock
    ages(heartbeats, now, {"a": T0})
    now.tick(2.0)
    name = next(iter(heartbeats._seen))  # noqa: SLF001 - torch's name for node "a"
    assert heartbeats.age_of(name, T0) == 2.0, "the same value: 2 s without a beat"
    assert heartbeats.age_of(name, T0 + timedelta(seconds=2)) == 0.0, "a new value: it beat"


def test_what_torch_writes_back_carries_the_values_its_nodes_wrote(clock) -> None:
    """Our rewrite must never look like a fresh heartbeat to another observer; torch's own change stays."""
    heartbeats, now = clock
    skewed, deadline = T0 + timedelta(seconds=30), T0 + timedelta(seconds=31)
    state = state_with({"a": skewed, "b": skewed, "dead": LONG_AGO}, deadline)
    heartbeats.present(state)
    assert state.deadline == now.wall + timedelta(seconds=1), "last call: 1 s after we first saw it"
    nodes = {node.addr: node for node in state.last_heartbeats}
    mine = now.wall + timedelta(seconds=5)
    state.last_heartbeats[nodes["b"]] = mine  # torch's keep-alive for node b, in b's own clock
    heartbeats.restore(state)
    assert state.last_heartbeats == {nodes["a"]: skewed, nodes["b"]: mine, nodes["dead"]: LONG_AGO}
    assert state.deadline == deadline


def test_torchs_sanitizer_keeps_a_node_whose_clock_is_30_s_behind() -> None:
    """Through RoundView, as the backend applies it: torch's own expiry rule sees a fresh heartbeat."""
    view = RoundView(WINDOW, None)
    behind = datetime.now(timezone.utc) - timedelta(seconds=30)
    shown = pickle.loads(view(pickle.dumps(state_with({"10.0.0.9": behind}))))  # noqa: S301 - our own pickle
    [beat] = shown.last_heartbeats.values()
    assert datetime.now(timezone.utc) - beat < WINDOW


def test_a_rounds_incumbents_are_every_member_it_had_while_they_leave_it() -> None:
    """The partition rule's tie-break prefers the last completed round's members (_partition.py). They leave
    it one by one when the next round forms, and a reader in between must still name them all."""
    view, now = RoundView(WINDOW, None), datetime.now(timezone.utc)

    def read(names: list[str], round_: int = 1, complete: bool = True) -> None:
        state = _RendezvousState()
        state.round, state.complete = round_, complete
        for name in names:  # torch names a node host_pid_local: here "n1_1_0"
            node = _NodeDesc(name, 1, 0)
            state.participants[node], state.last_heartbeats[node] = 0, now
        view(pickle.dumps(state))

    def named(*names: str) -> set[str]:
        return {f"{name}_1_0" for name in names}

    read(["n1", "n2"], complete=False)
    assert view.incumbents == set(), "an open round has no members yet"
    read(["n1", "n2"])
    read(["n1"])  # n2 left for the next round; the round stays complete until n1 leaves too
    assert view.incumbents == named("n1", "n2")
    read([], round_=2, complete=False)
    assert view.incumbents == named("n1", "n2"), "the next round is still forming"
    read(["n0", "n1", "n2"], round_=2)
    assert view.incumbents == named("n0", "n1", "n2")
    read(["n0"], round_=3)
    assert view.incumbents == named("n0"), "a newer completed round replaces them"


# --- beacons -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    with EtcdServer(enable_v2=False) as server:
        yield server


def liveness(server: EtcdServer, run_id: str) -> PeerLiveness:
    client = EtcdV3Client(EtcdConnectionSpec.parse(server.endpoint))
    return PeerLiveness(client, LeaseKeeper(client, 0), PREFIX, run_id, None)


def closed_address(host: str = "127.0.0.1") -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def test_a_beacon_says_whether_its_agent_reaches_etcd(etcd: EtcdServer) -> None:
    run_id = "reach"
    peer, me = liveness(etcd, run_id), liveness(etcd, run_id)
    peer.publish("peer_1_0")
    me.publish("me_1_0")
    assert me.gone(["peer_1_0"]) == set()  # lists the beacons: the peer is remembered for an outage
    assert me.others_reach_etcd(), "the peer's client answered etcd just now"
    peer.reach_window_s = 0.0
    assert not me.others_reach_etcd(), "a peer that does not reach etcd either: etcd is away"
    peer.reach_window_s, late = 3.0, liveness(etcd, run_id)
    late.learn_peers(1)  # what RoundView does once a round completes, without any probing
    assert late.others_reach_etcd(), "a node that never probed still knows whom to ask"


def test_a_beacon_taken_by_another_agent_is_published_again(etcd: EtcdServer) -> None:
    run_id = "republish"
    me, other = liveness(etcd, run_id), liveness(etcd, run_id)
    me.publish("me_1_0")
    client = raw_client(etcd)
    client.delete(f"{PREFIX}/{run_id}/probe/me_1_0")  # what forget() does after a wrong verdict
    client.put(f"{PREFIX}/{run_id}/probe/x_1_0", closed_address())
    assert me.gone(["x_1_0"]) == {"x_1_0"}
    assert client.get(f"{PREFIX}/{run_id}/probe/me_1_0")[0] is not None, "back: others probe us again"
    assert other.gone(["me_1_0"]) == set(), "and find it answering"
    client.close()


def test_a_probe_that_reaches_our_own_address_is_no_proof(etcd: EtcdServer) -> None:
    """Two hosts with the same private address (NAT, docker's 172.17.0.2): the other host's beacon
    address is also ours, so its refusal would come from our own kernel."""
    here = advertised_host("198.18.0.1", 9)  # this host's address on its default route
    assert not here.startswith("127."), f"the test needs a non-loopback address, found {here}"
    run_id = "same-address"
    me = liveness(etcd, run_id)
    me._beacon = Beacon(here)  # noqa: SLF001 - as publish() would on a host whose etcd route is `here`
    client = raw_client(etcd)
    client.put(f"{PREFIX}/{run_id}/probe/twin_1_0", f"{closed_address(here)} another-host-than-{socket.gethostname()}")
    client.close()
    assert me.gone(["twin_1_0"]) == set()
    me.close()


def test_a_heartbeat_that_turns_stale_is_probed_at_once(etcd: EtcdServer) -> None:
    """An agent asked a moment ago, while it still beat, is asked again as soon as its heartbeat turns
    stale: that is when a frozen agent (its kernel completes the handshake, the agent sends nothing) is found."""
    run_id, node = "turns-stale", "10.9.9.8_7_0"
    with socket.socket() as frozen:  # listens and never accepts: what a SIGSTOPped agent's beacon does
        frozen.bind(("127.0.0.1", 0))
        frozen.listen()
        client = raw_client(etcd)
        client.put(f"{PREFIX}/{run_id}/probe/{node}", f"127.0.0.1:{frozen.getsockname()[1]}")
        client.close()
        watcher = liveness(etcd, run_id)
        assert watcher.gone([node]) == set(), "it still beats: an agent that sends nothing is not judged"
        assert watcher.gone([node], stale=[node]) == {node}, "stale now: asked again at once, and found frozen"


def test_a_waiting_agent_looks_again_when_a_heartbeat_turns_stale(etcd: EtcdServer) -> None:
    """A frozen peer writes nothing, so the state does not change: the agent waiting in a forming round looks
    again when the peer's heartbeat turns stale, then each RECHECK_S, not a whole poll later."""
    now = FakeTime()
    view = RoundView(WINDOW, liveness(etcd, "next-look"))
    view.clock = HeartbeatClock(WINDOW, timedelta(seconds=1), lambda: now.mono, lambda: now.wall)
    forming = state_with({"peer": now.wall})
    forming.complete = False
    view(pickle.dumps(forming))
    assert 1.4 < view.next_look(5.0) <= 1.5, "its beat turns stale half a window (1.5 s) after we saw it"
    assert view.next_look(1.0) == 1.0, "never longer than the caller's poll"
    now.tick(2.0)
    view(pickle.dumps(forming))  # the same heartbeat 2 s later: stale
    assert 0.4 < view.next_look(5.0) <= RECHECK_S
    steady = state_with({"peer": now.wall})
    steady.complete = True
    view(pickle.dumps(steady))
    assert view.next_look(5.0) == 5.0, "a complete round nobody waits to join: the watch alone"


# --- etcd away -------------------------------------------------------------------------------------------

def stopped_for(server: EtcdServer, seconds: float) -> threading.Thread:
    """SIGSTOP etcd now (its port still accepts connections, nothing answers); SIGCONT after `seconds`."""
    os.kill(server.pid, signal.SIGSTOP)
    # the signal takes effect when the kernel next schedules etcd: on a loaded machine a request sent at once
    # could still be answered
    procs.wait_for(lambda: procs.proc_state(server.pid) == "T", 10, "etcd to stop", interval_s=0.005)
    thread = threading.Timer(seconds, os.kill, (server.pid, signal.SIGCONT))
    thread.start()
    return thread


@pytest.mark.slow
def test_an_outage_longer_than_read_timeout_is_ridden_out_unless_others_reach_etcd() -> None:
    with EtcdServer(enable_v2=False) as server:
        spec = EtcdConnectionSpec.parse(server.endpoint, read_timeout=1.0, outage_timeout=30.0)
        client = EtcdV3Client(spec)
        client.call("put", lambda c: c.put("/k", "v"))
        started, resume = time.monotonic(), stopped_for(server, 4.0)
        assert client.call("get", lambda c: c.get("/k")[0]) == b"v"
        assert time.monotonic() - started >= 3.5, "it waited for etcd, past read_timeout"
        resume.join()
        client.others_reach_etcd = lambda: True  # the peers' beacons: they still reach etcd
        started, resume = time.monotonic(), stopped_for(server, 6.0)
        with pytest.raises(EtcdV3Error, match="did not answer within read_timeout=1s"):
            client.call("get", lambda c: c.get("/k"))
        assert time.monotonic() - started < 4.0, "cut off alone: it leaves after read_timeout, as before"
        client.others_reach_etcd = lambda: False  # the peers finished and left before the next call asked
        started = time.monotonic()
        with pytest.raises(EtcdV3Error, match="did not answer within read_timeout=1s"):
            client.call("keep-alive", lambda c: c.get("/k"))  # torch's shutdown joins this thread's call
        assert time.monotonic() - started < 4.0, "the same outage: this host is still the one cut off"
        resume.join()
        assert client.call("get", lambda c: c.get("/k")[0]) == b"v", "etcd back: a new outage is judged anew"
        client.close()
