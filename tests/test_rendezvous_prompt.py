"""Prompt rounds of the etcd-v3 backend against real etcd, real agent processes and real signals: beacons
that refuse only when their process is gone (_liveness.py), a SIGKILLed node dropped without the
keep-alive window, no split round when a node joins, and SYNC woken by an etcd watch (_prompt.py).

    python -m pytest tests/test_rendezvous_prompt.py -q              # -m "not slow": no agent processes
"""

from __future__ import annotations

import json
import pickle
import queue
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from etcd_fixtures import raw_client, rdzv_params, wait_for_state
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elastic_mnist import procs
from elastic_mnist.etcd.client import EtcdConnectionSpec, EtcdV3Client
from elastic_mnist.etcd.lease import LeaseKeeper
from elastic_mnist.etcd.rdzv_state import open_lineage
from elastic_mnist.etcd.server import EtcdServer, free_port
from elastic_mnist.netprobe import probe
from elastic_mnist.rendezvous import EtcdV3ConfigError
from elastic_mnist.rendezvous._liveness import Beacon, PeerLiveness
from elastic_mnist.rendezvous._ordered import put as put_ordered
from elastic_mnist.rendezvous._prompt import LONG_AGO, RoundView

REPO = Path(__file__).resolve().parents[1]
PREFIX = "/torchelastic/v3"  # the default key_prefix
SLOW_WINDOW = {"keep_alive_interval": 5, "keep_alive_max_attempt": 6, "last_call_timeout": 30, "join_timeout": 120}

# One torchrun agent's rendezvous side, driven by lines on stdin; each command answers one JSON line.
AGENT = r"""
import json, sys, time
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from elastic_mnist.rendezvous._leave import leave
handler = None
print("{}", flush=True)  # torch is imported: ready for commands
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "open":
        p = json.loads(arg)
        handler = get_rendezvous_handler(RendezvousParameters(
            "etcd-v3", p.pop("endpoint"), p.pop("run_id"), p.pop("min"), p.pop("max"), local_addr="127.0.0.1",
            warm_start=0, **p))
        print(json.dumps({"node": str(handler._this_node)}), flush=True)
    elif cmd == "next":
        started = time.monotonic()
        info = handler.next_rendezvous()
        print(json.dumps({"rank": info.rank, "world": info.world_size, "started": started,
                          "returned": time.monotonic()}), flush=True)
    elif cmd == "leave":  # what the agent's exit runs (atexit), without exiting
        leave(handler, handler._state_holder._backend.client, handler._state_holder._backend.liveness)
    elif cmd == "shutdown":
        handler.shutdown()
    if cmd in ("leave", "shutdown"):
        print("{}", flush=True)
"""


class Agent:
    """A child process running AGENT (its stderr goes to pytest's capture); `ask` a command, get its answer."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=REPO, env=procs.child_env(),
                                     preexec_fn=procs.die_with_parent_preexec())
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self._lines.put(line)
        self._lines.put(None)

    def send(self, command: str, **params: Any) -> None:
        self.proc.stdin.write(f"{command} {json.dumps(params)}\n" if params else f"{command}\n")  # type: ignore
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def reply(self, timeout: float = 60) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"agent {self.proc.pid} did not answer within {timeout}s") from None
        if line is None:
            raise AssertionError(f"agent {self.proc.pid} exited ({self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def ask(self, command: str, timeout: float = 60, **params: Any) -> dict[str, Any]:
        self.send(command, **params)
        return self.reply(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def agents() -> Iterator[Callable[[int], list[Agent]]]:
    """agents(n): n agent processes, ready (they import torch side by side); all killed at the end."""
    started: list[Agent] = []

    def start(n: int) -> list[Agent]:
        batch = [Agent() for _ in range(n)]
        started.extend(batch)
        for agent in batch:
            agent.reply(120)  # importing torch on two busy cores
        return batch

    yield start
    for agent in started:
        agent.kill()


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    """One v3-only etcd; each test uses its own run ids."""
    with EtcdServer(enable_v2=False) as server:
        yield server


def probe_keys(server: EtcdServer, run_id: str) -> dict[str, bytes]:
    client = raw_client(server)
    try:
        directory = f"{PREFIX}/{run_id}/probe/"
        return {meta.key.decode()[len(directory):]: value for value, meta in client.get_prefix(directory)}
    finally:
        client.close()


def closed_address() -> str:
    """host:port where something listened and nothing does any more: a connection there is refused."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        return f"127.0.0.1:{listener.getsockname()[1]}"


# --- probe().refused: only a refusal counts ---------------------------------------------------------------

def test_a_live_beacon_answers_and_a_closed_port_refuses() -> None:
    live = Beacon("127.0.0.1")
    try:
        assert probe({"live": live.address, "closed": closed_address()}).refused == {"closed"}
        assert probe({"live": live.address}).refused == set(), "asked twice: the beacon keeps accepting"
    finally:
        live.close()


def accepting(thread: threading.Thread) -> bool:
    """Whether the thread sleeps in the kernel's accept(): wchan names the function it waits in."""
    with open(f"/proc/self/task/{thread.native_id}/wchan") as f:
        wchan = f.read()  # "0" while it runs
    return "accept" in wchan or "wait_for_connect" in wchan


def test_a_closed_beacon_refuses_at_once() -> None:
    before = set(threading.enumerate())  # beacons of earlier tests may still be blocked in accept()
    beacon = Beacon("127.0.0.1")
    [thread] = [t for t in set(threading.enumerate()) - before if t.name == "rdzv-beacon"]
    try:
        procs.wait_for(lambda: accepting(thread), 10, "the beacon's thread to block in accept()")
    except TimeoutError:
        pytest.skip("this kernel does not show where a thread sleeps (/proc/PID/task/TID/wchan)")
    beacon.close()
    assert probe({"closed": beacon.address}).refused == {"closed"}


def test_a_timeout_is_no_proof_of_death() -> None:
    """A listener whose accept queue is full drops the SYN (a vanished host looks the same); the probe times
    out within its timeout, all addresses at once, and only the refusal is reported."""
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    filler = socket.create_connection(full.getsockname())  # the one connection a backlog of 0 admits
    try:
        addresses = {"full": f"127.0.0.1:{full.getsockname()[1]}", "unroutable": "10.255.255.1:9",
                     "closed": closed_address(), "garbage": "no-port"}
        started = time.monotonic()
        assert probe(addresses, timeout=0.5).refused == {"closed"}
        assert time.monotonic() - started < 1.5, "probed in parallel, bounded by the timeout"
    finally:
        filler.close()
        full.close()


def test_a_frozen_process_is_not_refused() -> None:
    """SIGSTOP: the process cannot accept, but its kernel still completes the handshake."""
    code = ("from elastic_mnist.rendezvous._liveness import Beacon; import sys; "
            "b = Beacon('127.0.0.1'); print(b.address, flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=REPO, env=procs.child_env(), preexec_fn=procs.die_with_parent_preexec())
    try:
        address = child.stdout.readline().strip()  # type: ignore[union-attr]
        child.send_signal(signal.SIGSTOP)
        procs.wait_for(lambda: procs.proc_state(child.pid) == "T", 10, "the child to stop")
        assert probe({"frozen": address}, timeout=0.5).refused == set()
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait()
        assert probe({"killed": address}).refused == {"killed"}, "the same address refuses once the process is gone"
    finally:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait()


# --- PeerLiveness against etcd ------------------------------------------------------------------------

def liveness(server: EtcdServer, run_id: str, secret: bytes | None) -> PeerLiveness:
    client = EtcdV3Client(EtcdConnectionSpec.parse(server.endpoint))
    return PeerLiveness(client, LeaseKeeper(client, 60), PREFIX, run_id, secret)


def test_beacons_are_published_sealed_and_removed(etcd: EtcdServer) -> None:
    secret, run_id = b"s" * 32, "beacons"
    own = liveness(etcd, run_id, secret)
    own.publish("node-a")
    dead, directory = closed_address(), f"{PREFIX}/{run_id}/probe/"
    [(name, value)] = probe_keys(etcd, run_id).items()
    address = open_lineage(secret, directory + name, value)[0].decode()  # sealed with the job's secret, for this key
    assert name == "node-a" and probe({name: address}).refused == set()
    client, writer = raw_client(etcd), EtcdV3Client(EtcdConnectionSpec.parse(etcd.endpoint))
    client.put(directory + "forged", dead)  # someone without the secret: no proof of anything
    [sealed] = put_ordered(writer, LeaseKeeper(writer, 0), "a node of the job", [(directory + "sealed", dead.encode())],
                           secret)
    client.put(directory + "copied", sealed)  # bound to its key
    client.close()
    writer.close()
    observer = liveness(etcd, run_id, secret)
    assert observer.gone(["node-a", "forged", "sealed", "copied", "never-published"]) == {"sealed"}
    observer.forget("sealed")
    own.close()
    assert set(probe_keys(etcd, run_id)) == {"forged", "copied"}, "close() and forget() remove their keys"
    assert liveness(etcd, run_id, secret).gone(["node-a"]) == set(), "no key, no verdict"


def test_probing_is_on_by_default_and_off_with_peer_probe_0(etcd: EtcdServer) -> None:
    on = get_rendezvous_handler(rdzv_params(etcd.endpoint, "probe-on"))
    [(name, address)] = probe_keys(etcd, "probe-on").items()
    assert name == str(on._this_node) and probe({name: address.decode()}).refused == set()  # noqa: SLF001
    get_rendezvous_handler(rdzv_params(etcd.endpoint, "probe-off", peer_probe=0))
    assert probe_keys(etcd, "probe-off") == {}


def beat_is_fresh(view: RoundView, round_: int) -> bool:
    """What `view` makes of an open round whose one participant, 10.1.2.3_7_0, beat just now."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    node, state = _NodeDesc("10.1.2.3", 7, 0), _RendezvousState()
    state.round, state.participants, state.last_heartbeats = round_, {node: 0}, {node: datetime.now(timezone.utc)}
    [beat] = pickle.loads(view(pickle.dumps(state))).last_heartbeats.values()  # noqa: S301 - our own pickle
    return beat > LONG_AGO


def test_a_node_back_under_a_dead_nodes_name_is_not_dropped(etcd: EtcdServer) -> None:
    run_id, node = "reincarnated", "10.1.2.3_7_0"
    client = raw_client(etcd)
    client.put(f"{PREFIX}/{run_id}/probe/{node}", closed_address())  # its first life: gone
    client.close()
    view = RoundView(timedelta(seconds=30), liveness(etcd, run_id, None))
    assert not beat_is_fresh(view, 1), "a participant whose beacon refuses is aged out"
    liveness(etcd, run_id, None).publish(node)  # the same name again, with a beacon that answers
    assert beat_is_fresh(view, 2), "a live node's heartbeat is left alone"


@pytest.mark.parametrize("value, message", [
    ("2", "--rdzv-conf peer_probe='2' is out of range; give 0 or 1"),  # torchrun passes strings
    ("yes", "--rdzv-conf peer_probe='yes' is not an integer"),
])
def test_bad_peer_probe_is_rejected_by_name_before_connecting(value: Any, message: str) -> None:
    with pytest.raises(EtcdV3ConfigError, match=message):
        get_rendezvous_handler(rdzv_params(f"127.0.0.1:{free_port()}", peer_probe=value))


@pytest.mark.slow
def test_a_sigkilled_agent_is_reported_gone(etcd: EtcdServer, agents, tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("0123456789abcdef0123456789abcdef\n")
    (tmp_path / "secret").chmod(0o600)
    [agent], run_id = agents(1), "killed-agent"
    node = agent.ask("open", endpoint=etcd.endpoint, run_id=run_id, min=1, max=1,
                     secret_file=str(tmp_path / "secret"))["node"]
    secret = (tmp_path / "secret").read_bytes().strip()
    assert liveness(etcd, run_id, secret).gone([node]) == set(), "alive: it answers"
    agent.kill()
    assert liveness(etcd, run_id, secret).gone([node]) == {node}


# --- rounds with real agents --------------------------------------------------------------------------

def form_pair(server: EtcdServer, a: Agent, b: Agent, run_id: str, conf: dict[str, Any], b_min: int = 2) -> str:
    """B waits in round 0 (for b_min nodes), then A (min 1) completes it; B's node name."""
    b_node = b.ask("open", endpoint=server.endpoint, run_id=run_id, min=b_min, max=2, **conf)["node"]
    b.send("next")
    wait_for_state(server, run_id, lambda state: len(state.participants) == 1)
    a.ask("open", endpoint=server.endpoint, run_id=run_id, min=1, max=2, **conf)
    assert a.ask("next")["world"] == 2 and b.reply()["world"] == 2
    return b_node


@pytest.mark.slow
@pytest.mark.parametrize("peer_probe", [1, 0])
def test_a_sigkilled_node_is_dropped_without_the_keep_alive_window(etcd: EtcdServer, agents, peer_probe) -> None:
    """A 30 s heartbeat window and a 30 s last call: only the probe can let the survivor go on at once."""
    run_id, (a, b) = f"sigkill-{peer_probe}", agents(2)
    b_node = form_pair(etcd, a, b, run_id, {**SLOW_WINDOW, "peer_probe": peer_probe})
    b.kill()
    a.send("next")
    if peer_probe:
        answer = a.reply(timeout=10)
        elapsed = answer["returned"] - answer["started"]
        assert (answer["world"], answer["rank"]) == (1, 0)
        assert elapsed < 5, f"the survivor's round took {elapsed:.1f}s (heartbeat window 30 s)"
        assert b_node not in probe_keys(etcd, run_id), "the dead node's beacon key was removed"
    else:
        with pytest.raises(AssertionError, match="did not answer within 8s"):
            a.reply(timeout=8)  # without the probe, only the heartbeat window (30 s) drops the dead node
        state = wait_for_state(etcd, run_id, lambda state: True)
        assert b_node in {str(node) for node in state.participants}, "the dead node still holds its place"


@pytest.mark.slow
def test_a_joining_node_and_a_restarting_one_share_one_round(etcd: EtcdServer, agents) -> None:
    """A is alone in a complete round, B waits to join; A restarts (exit, join) while B joins. The node
    that exits keeps its heartbeat, so whoever adds itself first waits for the other: one 2-node round,
    never a 1-node round that leaves the other in the wait list. A race, so several times."""
    run_id, (a, b) = "no-split", agents(2)
    conf = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 30, "join_timeout": 120}
    form_pair(etcd, a, b, run_id, conf, b_min=1)
    for _ in range(3):
        b.ask("leave")  # B's node leaves (as at its agent's exit): A alone in a complete round
        alone = wait_for_state(etcd, run_id, lambda state: state.complete and len(state.participants) == 1)
        b.ask("open", endpoint=etcd.endpoint, run_id=run_id, min=1, max=2, **conf)  # a new node
        b.send("next")
        wait_for_state(etcd, run_id, lambda state: len(state.wait_list) == 1)
        a.send("next")
        joined = b.reply(timeout=20)
        assert joined["world"] == 2, "B completed a round without the restarting A: a split round"
        assert {joined["rank"], a.reply(timeout=20)["rank"]} == {0, 1}
        state = wait_for_state(etcd, run_id, lambda state: True)
        assert state.complete and len(state.participants) == 2 and state.round == alone.round + 1


@pytest.mark.slow
def test_a_waiting_node_sees_the_second_node_join_at_once(etcd: EtcdServer, agents) -> None:
    """A waits for a second node (min_nodes=2); B joins right after A's last look at the state. torch
    would sleep a second before its next look; the watch wakes A when B's write lands."""
    a, b = agents(2)
    delays = []
    for i in range(3):
        run_id = f"watch-{i}"
        for agent in (a, b):
            agent.ask("open", endpoint=etcd.endpoint, run_id=run_id, min=2, max=2)
        a.send("next")
        wait_for_state(etcd, run_id, lambda state: len(state.participants) == 1)
        b.send("next")
        answers = a.reply(), b.reply()
        assert [x["world"] for x in answers] == [2, 2]
        delays.append(answers[0]["returned"] - answers[1]["started"])
        for agent in (a, b):
            agent.ask("shutdown")
    assert statistics.median(delays) < 0.7, f"A returned {delays} s after B started joining"


def test_a_loopback_beacon_is_probed_only_on_the_host_that_published_it(etcd: EtcdServer) -> None:
    """Where every host reaches etcd through 127.0.0.1 (a local proxy), another host's loopback beacon
    would be our own loopback: its refusal proves nothing about that node."""
    run_id, here = "loopback", socket.gethostname()
    client = raw_client(etcd)
    client.put(f"{PREFIX}/{run_id}/probe/there_1_0", f"{closed_address()} another-host-than-{here}")
    client.put(f"{PREFIX}/{run_id}/probe/here_1_0", f"{closed_address()} {here}")
    client.close()
    assert liveness(etcd, run_id, None).gone(["there_1_0", "here_1_0"]) == {"here_1_0"}


def test_refused_ignores_what_is_not_a_numeric_address() -> None:
    """A malformed published value must not break the state read, nor cost a DNS lookup."""
    bad = {"port": "127.0.0.1:99999", "name": "localhost:80", "junk": "nonsense"}
    assert probe({**bad, "closed": closed_address()}).refused == {"closed"}


def _aged(view: RoundView, beat: datetime) -> bool:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    node, state = _NodeDesc("10.9.9.9", 7, 0), _RendezvousState()
    state.round, state.participants, state.last_heartbeats = 1, {node: 0}, {node: beat}
    [seen] = pickle.loads(view(pickle.dumps(state))).last_heartbeats.values()  # noqa: S301 - our own pickle
    return seen == LONG_AGO


def test_a_dead_node_stays_dead_in_stale_states_until_it_beats_again(etcd: EtcdServer) -> None:
    """Its key goes with the first verdict; a stale state (the old heartbeat) is aged again from memory, and
    a newer heartbeat (which a dead agent cannot write) ends the verdict: a wrong refusal does not last."""
    run_id, node = "stale-states", "10.9.9.9_7_0"
    client = raw_client(etcd)
    client.put(f"{PREFIX}/{run_id}/probe/{node}", closed_address())
    client.close()
    view, then = RoundView(timedelta(seconds=30), liveness(etcd, run_id, None)), datetime.now(timezone.utc)
    assert _aged(view, then) and probe_keys(etcd, run_id) == {}, "refused: aged, its key removed"
    assert _aged(view, then), "a stale state naming it with the same heartbeat"
    assert not _aged(view, then + timedelta(seconds=1)), "it wrote a newer heartbeat: alive"


def test_a_dead_nodes_key_rewritten_since_the_probe_is_kept_and_we_never_judge_ourselves(etcd: EtcdServer) -> None:
    run_id = "rewritten"
    client = raw_client(etcd)
    client.put(f"{PREFIX}/{run_id}/probe/x_1_0", closed_address())
    observer = liveness(etcd, run_id, None)
    assert observer.gone(["x_1_0"]) == {"x_1_0"}
    client.put(f"{PREFIX}/{run_id}/probe/x_1_0", closed_address())  # the same name published again meanwhile
    observer.forget("x_1_0")
    assert set(probe_keys(etcd, run_id)) == {"x_1_0"}, "forget() removes only the key it probed"
    client.close()
    me = liveness(etcd, run_id, None)
    me.publish("me_1_0")
    me._beacon.close()  # noqa: SLF001 - even a refusing beacon of our own is no verdict on us
    assert me.gone(["me_1_0"]) == set()
