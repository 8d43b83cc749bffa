"""The etcd-v3 rendezvous backend against a real etcd serving the v3 API only (no v2, no mocks).

    python -m pytest tests/test_rendezvous_etcd_v3.py -q
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from etcd_fixtures import (  # noqa: F401  (etcd_server* are pytest fixtures)
    etcd_server,
    etcd_server_v3only,
    raw_client,
    rdzv_params,
    state_bits,
    wait_for_state,
    write_test_pki,
)
from torch.distributed import DistStoreError, PrefixStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

import elastic_mnist.rendezvous as rdzv
from elastic_mnist.etcd.rdzv_status import decode_state
from elastic_mnist.etcd.server import EtcdServer, free_port
from elastic_mnist.rendezvous import EtcdV3ConfigError, create_backend, read_rendezvous_status

REPO = Path(__file__).resolve().parents[1]


S = {i: state_bits(i) for i in range(1, 11)}
FAST = {"keep_alive_interval": 1, "keep_alive_max_attempt": 2, "last_call_timeout": 1, "join_timeout": 120}


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    """One v3-only etcd for the tests that only need distinct run ids, not a fresh server."""
    with EtcdServer(enable_v2=False) as server:
        yield server


def test_backend_round_trip_with_fencing_tokens_and_a_lease(etcd: EtcdServer) -> None:
    backend, _ = create_backend(rdzv_params(etcd.endpoint, "roundtrip"))
    assert backend.name == "etcd-v3" and backend.key == "/torchelastic/v3/roundtrip/state"
    assert backend.get_state() is None
    state, token, ok = backend.set_state(S[1])
    assert (state, ok) == (S[1], True)
    assert backend.set_state(S[2], None) == (S[1], token, False), "no token: create only if absent"
    state2, token2, ok2 = backend.set_state(S[3], token)
    assert (state2, ok2) == (S[3], True) and token2 > token
    assert backend.set_state(S[4], token) == (S[3], token2, False), "a stale token loses"
    assert backend.set_state(S[5], "not-our-token") == (S[3], token2, False)
    assert backend.get_state() == (S[3], token2)
    client = raw_client(etcd)
    meta = client.get(backend.key)[1]
    assert meta.lease_id and 7000 < client.get_lease_info(meta.lease_id).TTL <= 7200
    other, _ = create_backend(rdzv_params(etcd.endpoint, "another-job"))
    assert other.get_state() is None, "a different run id never sees this job's keys"
    client.close()


def test_lease_can_be_disabled_and_is_regranted_when_revoked(etcd: EtcdServer) -> None:
    plain, _ = create_backend(rdzv_params(etcd.endpoint, lease_ttl=0))
    plain.set_state(S[6])
    client = raw_client(etcd)
    assert client.get(plain.key)[1].lease_id == 0
    backend, _ = create_backend(rdzv_params(etcd.endpoint, lease_ttl=60))
    backend.set_state(S[6])
    client.revoke_lease(client.get(backend.key)[1].lease_id)  # deletes the key with it
    assert backend.get_state() is None
    assert backend.set_state(S[7])[2] is True, "a fresh lease is granted when etcd forgot ours"
    assert client.get(backend.key)[1].lease_id
    client.close()


def test_concurrent_writers_with_the_same_token_exactly_one_wins(etcd: EtcdServer) -> None:
    run_id, writers = "race", 8
    backends = [create_backend(rdzv_params(etcd.endpoint, run_id))[0] for _ in range(writers)]  # own connections
    _, token, _ = backends[0].set_state(S[8])
    start, results = threading.Barrier(writers), [None] * writers

    def write(i: int) -> None:
        start.wait()
        results[i] = backends[i].set_state(state_bits(100 + i), token)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    winners = [r for r in results if r and r[2]]
    assert len(winners) == 1, results
    assert {(r[0], r[1]) for r in results} == {(winners[0][0], winners[0][1])}, "losers see the winner's state"


def test_store_follows_c10d_semantics(etcd: EtcdServer) -> None:
    _, store = create_backend(rdzv_params(etcd.endpoint))
    store.set_timeout(timedelta(seconds=30))
    store.set("a", "1")
    assert store.get("a") == b"1" and store.check(["a"]) and not store.check(["a", "b"])
    assert store.add("n", 1) == 1 and store.add("n", 5) == 6
    assert store.compare_set("c", "", "v1") == b"v1", "absent + empty expected: set"
    assert store.compare_set("c", "wrong", "v2") == b"v1", "mismatch: current value back"
    assert store.compare_set("c", "v1", "v2") == b"v2"
    assert store.compare_set("missing", "x", "y") == b"x" and not store.check(["missing"])
    assert store.num_keys() == 3 and store.delete_key("c") and not store.delete_key("c")
    with pytest.raises(DistStoreError, match="Timeout"):
        store.wait(["never"], timedelta(seconds=1))
    store.set_timeout(timedelta(seconds=1))
    with pytest.raises(DistStoreError):
        store.get("never")
    store.set_timeout(timedelta(seconds=30))
    adders = [threading.Thread(target=lambda: [store.add("counter", 1) for _ in range(10)]) for _ in range(4)]
    [t.start() for t in adders]
    [t.join(60) for t in adders]
    assert store.get("counter") == b"40", "concurrent adds are atomic"


def test_store_blocks_until_another_writer_publishes(etcd: EtcdServer) -> None:
    """What torch's agents do: PrefixStore per round, rank 0 publishes, the others block in get/wait."""
    p = rdzv_params(etcd.endpoint)
    # Keep the Python stores referenced, as the handler does: a PrefixStore alone does not keep the
    # Python half of a Python-implemented Store alive.
    stores = [create_backend(p)[1] for _ in range(2)]
    reader, writer = (PrefixStore("torch.rendezvous.job.0", s) for s in stores)
    got: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: got.update(v=reader.get("MASTER_ADDR"), m=reader.multi_get(["a", "b"])))
    waiter.start()
    writer.multi_set(["a", "b"], ["1", "2"])
    writer.set("MASTER_ADDR", b"127.0.0.1")
    waiter.join(60)
    assert got == {"v": b"127.0.0.1", "m": [b"1", b"2"]}
    reader.wait(["a"], timedelta(seconds=5))
    assert writer.add("members", 1) == 1 and reader.add("members", 1) == 2


def test_entry_point_resolves_through_torchs_registry(etcd: EtcdServer) -> None:
    assert "etcd-v3" in entry_points(group="torchrun.handlers").names
    assert rendezvous_handler_registry._registry["etcd-v3"] is rdzv.create_rdzv_handler
    handler = get_rendezvous_handler(rdzv_params(etcd.endpoint, keep_alive_interval=2, join_timeout=77))
    assert isinstance(handler, DynamicRendezvousHandler) and handler.get_backend() == "etcd-v3"
    assert handler.settings.keep_alive_interval == timedelta(seconds=2)
    assert handler.settings.timeout.join == timedelta(seconds=77)
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    handler.shutdown()
    assert read_rendezvous_status(etcd.endpoint, handler.get_run_id())["phase"] == "closed"


def test_tuned_defaults_apply_unless_a_key_is_given(etcd: EtcdServer) -> None:
    from elastic_mnist.contract.torchrun import RDZV_CONF

    tuned = RDZV_CONF["etcd-v3"]
    handler = get_rendezvous_handler(rdzv_params(etcd.endpoint, last_call_timeout=7))
    settings = handler.settings
    assert settings.keep_alive_interval == timedelta(seconds=tuned["keep_alive_interval"])
    assert settings.keep_alive_max_attempt == tuned["keep_alive_max_attempt"]
    assert settings.timeout.join == timedelta(seconds=tuned["join_timeout"])
    assert settings.timeout.last_call == timedelta(seconds=7), "an explicit key wins"
    assert (tuned["keep_alive_interval"], tuned["last_call_timeout"]) != (5, 30), "not torch's own defaults"


@pytest.mark.parametrize("conf, message", [
    ({"bogus_key": 1, "another": 2}, r"unknown --rdzv-conf key\(s\) for etcd-v3: another, bogus_key; valid keys: .*"
                                     r"join_timeout"),
    ({"lease_ttl": 5}, "lease_ttl=5 must be 0"),
    ({"protocol": "ftp"}, "protocol must be http or https"),
    ({"protocol": "https", "cacert": "/nonexistent/ca.pem"}, "cacert file '/nonexistent/ca.pem' does not exist"),
    ({"user": "root"}, "needs both user=NAME and password_file=PATH"),
    ({"user": "root", "password_file": "/nonexistent/pw"}, "cannot read the etcd password file '/nonexistent/pw'"),
    ({"secret_file": "/nonexistent/secret"}, "cannot read the rendezvous secret file '/nonexistent/secret'"),
    ({"keep_alive_interval": "soon"}, "keep_alive_interval='soon' is not an integer"),
])
def test_bad_rdzv_conf_is_rejected_by_name_before_connecting(conf: dict[str, Any], message: str) -> None:
    with pytest.raises(EtcdV3ConfigError, match=message):
        get_rendezvous_handler(rdzv_params(f"127.0.0.1:{free_port()}", **conf))


def test_unreachable_etcd_fails_fast_naming_the_endpoint() -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"etcd at http://{endpoint} is unreachable"):
        get_rendezvous_handler(rdzv_params(endpoint))
    assert time.monotonic() - started < 10


AGENT_B = """
import sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
params = RendezvousParameters("etcd-v3", sys.argv[1], sys.argv[2], 2, 2, local_addr="127.0.0.1",
                              keep_alive_interval=1, keep_alive_max_attempt=2, join_timeout=120, warm_start=0)
info = get_rendezvous_handler(params).next_rendezvous()
print(info.rank, info.world_size, flush=True)
sys.stdin.read()  # alive and heartbeating until killed
"""


@pytest.mark.slow
def test_two_agents_rendezvous_and_a_dead_one_is_dropped_within_the_keep_alive_bound(
        etcd_server_v3only: EtcdServer) -> None:  # noqa: F811
    server, run_id = etcd_server_v3only, "two-agents"
    # B needs 2 nodes, so it cannot close a round alone; A (min 1) then completes it by joining.
    b = subprocess.Popen([sys.executable, "-c", AGENT_B, server.endpoint, run_id], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        wait_for_state(server, run_id, lambda state: len(state.participants) == 1)
        a = get_rendezvous_handler(rdzv_params(server.endpoint, run_id, 1, 2, **FAST))
        info = a.next_rendezvous()
        b_rank, b_world = map(int, b.stdout.readline().split())  # type: ignore[union-attr]
        assert (info.world_size, b_world) == (2, 2) and {info.rank, b_rank} == {0, 1}
        b.send_signal(signal.SIGKILL)  # B dies without a word: only its missing heartbeats tell
        b.wait()
        started = time.monotonic()
        info = a.next_rendezvous()
        elapsed = time.monotonic() - started
        bound = FAST["keep_alive_interval"] * FAST["keep_alive_max_attempt"] + FAST["last_call_timeout"] + 1
        assert (info.rank, info.world_size) == (0, 1)
        assert elapsed < bound + 5, f"survivor's round took {elapsed:.1f}s; keep-alive bound {bound}s"
        status = read_rendezvous_status(server.endpoint, run_id)
        [survivor] = [p["node"] for p in status["participants"]]
        assert status["phase"] == "complete" and survivor.startswith(f"127.0.0.1_{os.getpid()}_")
        a.shutdown()
    finally:
        b.kill()
        b.wait()


def test_backend_and_store_survive_an_etcd_restart(etcd_server_v3only: EtcdServer) -> None:  # noqa: F811
    server = etcd_server_v3only
    backend, store = create_backend(rdzv_params(server.endpoint, "restart"))
    _, token, _ = backend.set_state(S[9])
    store.set("k", "v")
    server.restart()  # every gRPC channel breaks; calls reconnect by themselves
    assert backend.get_state() == (S[9], token)
    assert store.get("k") == b"v"
    assert backend.set_state(S[10], token)[2] is True


def test_tls_with_client_certificates(tmp_path: Path) -> None:
    pki = write_test_pki(tmp_path / "pki")
    tls = {"cert_file": pki["cert"], "key_file": pki["key"], "trusted_ca_file": pki["ca"]}
    with EtcdServer(enable_v2=False, tls=tls) as server:
        good = {"protocol": "https", "cacert": pki["ca"], "cert": pki["cert"], "key": pki["key"]}
        handler = get_rendezvous_handler(rdzv_params(server.endpoint, **good))
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        handler.shutdown()
        with pytest.raises(RendezvousConnectionError, match=f"TLS with etcd at https://{server.endpoint} failed"):
            get_rendezvous_handler(rdzv_params(server.endpoint, **{**good, "cacert": pki["other_ca"]}))
        with pytest.raises(RendezvousConnectionError, match=f"etcd at https://{server.endpoint} requires a client "
                                                            "certificate .*add cert=PATH,key=PATH"):
            get_rendezvous_handler(rdzv_params(server.endpoint, protocol="https", cacert=pki["ca"]))
        with pytest.raises(RendezvousConnectionError, match=f"etcd at http://{server.endpoint} answers with TLS, not "
                                                            "plain http: add protocol=https"):
            get_rendezvous_handler(rdzv_params(server.endpoint))


def test_user_password_auth_enabled_with_etcdctl(etcd_server_v3only: EtcdServer,  # noqa: F811
                                                 tmp_path: Path) -> None:
    server = etcd_server_v3only
    etcdctl = str(Path(server.binary).with_name("etcdctl"))
    for args in (["user", "add", "root:s3cret"], ["auth", "enable"]):
        subprocess.run([etcdctl, f"--endpoints={server.client_url}", *args], check=True, capture_output=True,
                       timeout=60)
    (tmp_path / "pw").write_text("s3cret\n")  # as `echo s3cret > pw` writes it
    (tmp_path / "pw").chmod(0o600)
    (tmp_path / "wrong").write_text("wrong")
    (tmp_path / "wrong").chmod(0o600)
    handler = get_rendezvous_handler(rdzv_params(server.endpoint, user="root", password_file=str(tmp_path / "pw")))
    assert handler.next_rendezvous().world_size == 1
    handler.shutdown()
    with pytest.raises(RendezvousConnectionError, match="rejected user 'root': wrong user name or password"):
        get_rendezvous_handler(rdzv_params(server.endpoint, user="root", password_file=str(tmp_path / "wrong")))
    with pytest.raises(RendezvousConnectionError, match="requires authentication: pass --rdzv-conf "
                                                        "user=NAME,password_file=PATH"):
        get_rendezvous_handler(rdzv_params(server.endpoint))


def test_state_decoder_matches_torch_and_refuses_other_classes() -> None:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    node = _NodeDesc("host-a", 42, 3)
    state = _RendezvousState()
    state.round, state.complete, state.participants = 7, True, {node: 0}
    state.last_heartbeats = {node: datetime.now(timezone.utc)}
    state.wait_list = {_NodeDesc("host-b", 43, 0)}
    decoded = decode_state(pickle.dumps(state))
    assert (decoded.round, decoded.complete) == (7, True)
    assert [repr(n) for n in decoded.participants] == ["host-a_42_3"] and decoded.wait_list
    with pytest.raises(pickle.UnpicklingError, match="unexpected class"):
        decode_state(pickle.dumps(Path("/etc")))


# torch's legacy handler refreshes its keep-alive key from a thread that outlives shutdown() and
# trips over etcd 3.5's v2 emulation ("Not a file"): torch's noise, not this backend's.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_status_reads_the_legacy_etcd_backend(etcd_server: EtcdServer) -> None:  # noqa: F811
    legacy = RendezvousParameters("etcd", etcd_server.endpoint, "legacy", 1, 1, local_addr="127.0.0.1", timeout=60,
                                  last_call_timeout=1)
    handler = get_rendezvous_handler(legacy)
    handler.next_rendezvous()
    status = read_rendezvous_status(etcd_server.endpoint, "legacy", backend="etcd")
    assert status["found"] and status["phase"] == "complete" and status["round"] == 1
    assert [p["rank"] for p in status["participants"]] == [0]
    assert not read_rendezvous_status(etcd_server.endpoint, "other", backend="etcd")["found"]
    handler.shutdown()


def torchrun(endpoint: str, *extra: str, nnodes: str = "2") -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
            "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}", "--rdzv-id=smoke", "--max-restarts=0",
            "--local-addr=127.0.0.1", *extra, str(REPO / "tests" / "rdzv_tiny_worker.py")]


@pytest.mark.slow
@pytest.mark.e2e
def test_torchrun_two_nodes_all_reduce_over_etcd_v3(etcd_server_v3only: EtcdServer) -> None:  # noqa: F811
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = torchrun(etcd_server_v3only.endpoint, "--rdzv-conf=join_timeout=120,last_call_timeout=1")
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
             for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        [node.kill() for node in nodes if node.poll() is None]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    lines = sorted(line.split("]:")[-1].strip() for out in outputs for line in out.splitlines() if "sum" in line)
    assert lines == ["rank 0 world 2 sum 2", "rank 1 world 2 sum 2"], outputs


@pytest.mark.slow
@pytest.mark.e2e
def test_torchrun_reports_an_unknown_rdzv_conf_key() -> None:
    result = subprocess.run(torchrun(f"127.0.0.1:{free_port()}", "--rdzv-conf=bogus_key=1", nnodes="1"),
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("elastic-mnist etcd-v3: error:")]
    assert len(lines) == 1 and "unknown --rdzv-conf key(s) for etcd-v3: bogus_key; valid keys:" in lines[0]
    assert result.stderr.index(lines[0]) < result.stderr.index("Traceback"), "the one line comes before the traceback"


@pytest.mark.slow
def test_a_crashed_jobs_state_never_blocks_a_new_job_id(etcd_server_v3only: EtcdServer) -> None:  # noqa: F811
    """Job A's agent dies mid-round (its state stays in etcd); job B, with a new id, forms its round at once."""
    server = etcd_server_v3only
    crashed = subprocess.Popen([sys.executable, "-c", AGENT_B, server.endpoint, "job-a"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        wait_for_state(server, "job-a", lambda state: len(state.participants) == 1)
        crashed.send_signal(signal.SIGKILL)
        crashed.wait()
        started = time.monotonic()
        handler = get_rendezvous_handler(rdzv_params(server.endpoint, "job-b", 1, 2, **FAST))
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert time.monotonic() - started < FAST["last_call_timeout"] + 10
        assert read_rendezvous_status(server.endpoint, "job-a")["found"], "job A's stale state is still there"
        handler.shutdown()
    finally:
        crashed.kill()
        crashed.wait()


def _open_round(round_: int, participants: list[str], heartbeats: dict[str, float]):
    """torch's own _RendezvousState: an open round with a last-call deadline 60 s away."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    now = datetime.now(timezone.utc)
    state = _RendezvousState()
    state.round, state.deadline = round_, now + timedelta(seconds=60)
    nodes = {name: _NodeDesc("10.0.0.1", i, 0) for i, name in enumerate(sorted(heartbeats))}
    state.participants = {nodes[n]: 0 for n in participants}
    state.last_heartbeats = {nodes[n]: now - timedelta(seconds=age) for n, age in heartbeats.items()}
    return state


@pytest.mark.parametrize("round_, participants, heartbeats, closes", [
    (1, ["a"], {"a": 0}, True),                 # the lone survivor: nobody else to wait for
    (1, ["a"], {"a": 0, "dead": 9}, True),      # a heartbeat older than the window is nobody
    (1, ["a"], {"a": 0, "waiting": 0.5}, False),  # a live node not yet in: its last call stays
    (0, ["a"], {"a": 0}, False),                # cold start: how many are coming is unknown
])
def test_last_call_is_skipped_only_when_every_live_node_is_in(round_, participants, heartbeats, closes) -> None:
    from elastic_mnist.rendezvous._prompt import close_when_everyone_is_in

    state = _open_round(round_, participants, heartbeats)
    assert close_when_everyone_is_in(state, timedelta(seconds=3)) is closes
    assert (state.deadline < datetime.now(timezone.utc)) is closes


@pytest.mark.slow
def test_survivor_completes_its_round_without_the_last_call(etcd_server_v3only: EtcdServer) -> None:  # noqa: F811
    """last_call_timeout=60: without the shortcut the survivor's round would take a minute."""
    server, run_id = etcd_server_v3only, "no-last-call"
    b = subprocess.Popen([sys.executable, "-c", AGENT_B, server.endpoint, run_id], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        wait_for_state(server, run_id, lambda state: len(state.participants) == 1)
        a = get_rendezvous_handler(rdzv_params(server.endpoint, run_id, 1, 2, **{**FAST, "last_call_timeout": 60}))
        assert a.next_rendezvous().world_size == 2
        b.send_signal(signal.SIGKILL)
        b.wait()
        started = time.monotonic()
        info = a.next_rendezvous()
        elapsed = time.monotonic() - started
        window = FAST["keep_alive_interval"] * FAST["keep_alive_max_attempt"]
        assert (info.rank, info.world_size) == (0, 1)
        assert elapsed < window + 4, f"survivor's round took {elapsed:.1f}s (keep-alive window {window}s)"
        a.shutdown()
    finally:
        b.kill()
        b.wait()


AGENT_LEAVING = """
import signal, sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # as torchrun's agent: the signal raises, the process exits
params = RendezvousParameters("etcd-v3", sys.argv[1], sys.argv[2], 2, 2, local_addr="127.0.0.1",
                              keep_alive_interval=5, keep_alive_max_attempt=3, join_timeout=120, warm_start=0)
info = get_rendezvous_handler(params).next_rendezvous()
print(info.rank, info.world_size, flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_an_agent_ended_by_sigterm_leaves_without_the_heartbeat_window(etcd_server_v3only: EtcdServer) -> None:  # noqa: F811
    """A 15 s heartbeat window and a 60 s last call: the survivor re-forms within a few polls because
    the leaving agent took itself out of the state on its way out."""
    server, run_id = etcd_server_v3only, "sigterm-leaves"
    b = subprocess.Popen([sys.executable, "-c", AGENT_LEAVING, server.endpoint, run_id], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        wait_for_state(server, run_id, lambda state: len(state.participants) == 1)
        slow = {"keep_alive_interval": 5, "keep_alive_max_attempt": 3, "last_call_timeout": 60, "join_timeout": 120}
        a = get_rendezvous_handler(rdzv_params(server.endpoint, run_id, 1, 2, **slow))
        assert a.next_rendezvous().world_size == 2
        b.send_signal(signal.SIGTERM)
        assert b.wait(timeout=30) == 1
        started = time.monotonic()
        info = a.next_rendezvous()
        elapsed = time.monotonic() - started
        assert (info.rank, info.world_size) == (0, 1)
        assert elapsed < 5, f"survivor's round took {elapsed:.1f}s; the heartbeat window alone is 15 s"
        a.shutdown()
        assert read_rendezvous_status(server.endpoint, run_id)["phase"] == "closed"
    finally:
        b.kill()
        b.wait()


AGENT_INTERRUPTED = """
import sys, threading
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from elastic_mnist import procs
params = RendezvousParameters("etcd-v3", sys.argv[1], sys.argv[2], 2, 2, local_addr="127.0.0.1",
                              keep_alive_interval=1, keep_alive_max_attempt=30, join_timeout=120, warm_start=0)
handler = get_rendezvous_handler(params)
info = handler.next_rendezvous()
print(info.rank, info.world_size, flush=True)
sys.stdin.readline()

def grpc_frame(frame):
    return frame is not None and frame.f_code.co_filename.endswith("grpc/_channel.py")

def interrupt(frame, event, arg):  # torchrun's SIGTERM handler raising as gRPC releases its channel's lock
    if event == "call" and frame.f_code.co_name == "__exit__" and grpc_frame(frame.f_back):
        sys.settrace(None)
        raise SignalException("Process got signal: 15", sigval=15)
    return None

def beat_stuck():
    beats = [t for t in threading.enumerate() if t.name.startswith("RendezvousKeepAliveTimer")]
    frames = [sys._current_frames().get(t.ident) for t in beats]
    return any(f is not None and f.f_code.co_name == "__enter__" and grpc_frame(f.f_back) for f in frames)

sys.settrace(interrupt)
try:
    handler.num_nodes_waiting()  # the monitor loop's poll
finally:
    sys.settrace(None)
    procs.wait_for(beat_stuck, 10, "the keep-alive thread blocked on the lock the signal left held")
    print("stuck", flush=True)
"""


@pytest.mark.slow
def test_an_agent_signalled_inside_a_grpc_call_still_exits_and_leaves(etcd_server_v3only: EtcdServer) -> None:  # noqa: F811
    """The signal's exception leaves the channel's lock held and the keep-alive thread blocked on it for
    good; the exit is still bounded, and the leave still happens (over a new channel): the survivor
    re-forms in seconds, not after the 30 s heartbeat window."""
    from elastic_mnist.rendezvous._leave import EXIT_WAIT_S

    server, run_id = etcd_server_v3only, "interrupted-leaves"
    b = subprocess.Popen([sys.executable, "-c", AGENT_INTERRUPTED, server.endpoint, run_id], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        wait_for_state(server, run_id, lambda state: len(state.participants) == 1)
        slow = {"keep_alive_interval": 5, "keep_alive_max_attempt": 6, "last_call_timeout": 60, "join_timeout": 120}
        a = get_rendezvous_handler(rdzv_params(server.endpoint, run_id, 1, 2, **slow))
        assert a.next_rendezvous().world_size == 2
        assert b.stdout.readline().split()[1] == "2"
        b.stdin.write("go\n")
        b.stdin.flush()
        assert b.stdout.readline() == "stuck\n", b.stderr.read()
        stuck_at = time.monotonic()
        assert b.wait(timeout=EXIT_WAIT_S + 10) == 1
        assert time.monotonic() - stuck_at < EXIT_WAIT_S + 2
        started = time.monotonic()
        info = a.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert time.monotonic() - started < 5, "the survivor waited out the heartbeat window: no leave"
        a.shutdown()
    finally:
        b.kill()
        b.wait()
