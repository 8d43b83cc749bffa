"""What the job's secret covers beyond the HMAC of one state: store values, and replays of older states,
store values and beacon reports.

    python -m pytest -q tests/test_sealing.py

A real etcd and the real backend and store; the attacker is a plain etcd client without the secret.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
from etcd_fixtures import raw_client, rdzv_params, state_bits
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elastic_mnist.compat import private as compat
from elastic_mnist.etcd.client import EtcdConnectionSpec, EtcdV3Client, run_key
from elastic_mnist.etcd.lease import LeaseKeeper
from elastic_mnist.etcd.rdzv_state import seal, verified
from elastic_mnist.etcd.server import EtcdServer
from elastic_mnist.rendezvous import create_backend
from elastic_mnist.rendezvous._liveness import PeerLiveness
from elastic_mnist.rendezvous._partition import losing_side

FAST = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 1, "join_timeout": 60}


def _secret(tmp_path: Path) -> str:
    path = tmp_path / "rdzv-secret"
    path.write_text("s" * 32 + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def etcd_server_v3only(etcd_v3only_wiped):
    """One etcd for the module, emptied before each test (each test's keys are its own)."""
    return etcd_v3only_wiped


def test_a_store_value_planted_without_the_secret_is_never_returned(tmp_path, etcd_server_v3only: EtcdServer,
                                                                   capsys) -> None:
    _, store = create_backend(rdzv_params(etcd_server_v3only.endpoint, "job", secret_file=_secret(tmp_path)))
    store.set_timeout(timedelta(seconds=30))
    planted = store.prefix + "MASTER_ADDR"
    raw = raw_client(etcd_server_v3only)
    raw.put(planted, b"attacker.example")
    assert not store.check(["MASTER_ADDR"]), "a value that does not verify counts as absent"
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(store.get("MASTER_ADDR")))
    reader.start()  # blocks on the etcd watch: the planted value does not satisfy it
    raw.put(store.prefix + "other", b"wakes the watch")  # any change makes the reader look again
    store.set("MASTER_ADDR", "10.0.0.1")  # the genuine write, by a node of the job
    reader.join(30)
    assert got == [b"10.0.0.1"]
    assert "ignoring the store value under" in capsys.readouterr().err
    # Sealed by the job, but under another key: a value cannot be moved to where it was not written.
    raw.put(planted, seal((tmp_path / "rdzv-secret").read_bytes().strip(), store.prefix + "MASTER_PORT", b"1"))
    assert not store.check(["MASTER_ADDR"])
    assert store.add("MASTER_ADDR", 5) == 5, "a read-modify-write replaces what does not verify"
    assert store.get("MASTER_ADDR") == b"5"


def test_without_a_secret_store_values_stay_plain(etcd_server_v3only: EtcdServer) -> None:
    _, store = create_backend(rdzv_params(etcd_server_v3only.endpoint, "plain"))
    store.set("k", "v")
    assert raw_client(etcd_server_v3only).get(store.prefix + "k")[0] == b"v"


def test_an_older_sealed_state_written_back_is_refused(tmp_path, etcd_server_v3only: EtcdServer) -> None:
    params = rdzv_params(etcd_server_v3only.endpoint, "replay", secret_file=_secret(tmp_path))
    backend, _ = create_backend(params)
    raw = raw_client(etcd_server_v3only)
    _, token, created = backend.set_state(state_bits(0))
    assert created
    first = raw.get(backend.key)[0]
    for round_ in (1, 2):  # the protocol itself goes on: each write over the token read last
        _, token, ok = backend.set_state(state_bits(round_), token)
        assert ok
    raw.put(backend.key, first)  # the attacker writes round 0's sealed state back
    with pytest.raises(RendezvousStateError, match="replay"):
        backend.get_state()
    with pytest.raises(RendezvousStateError, match="replay"):  # a node with no memory (a restarted agent)
        create_backend(params)
    raw.delete(backend.key)  # deleted, then the very first state written back: etcd's metadata fits it,
    raw.put(backend.key, first)  # but this node has seen later states
    with pytest.raises(RendezvousStateError, match="older than a state this node already saw"):
        backend.get_state()


def test_the_rendezvous_is_not_fooled_by_a_replayed_round(tmp_path, etcd_server_v3only: EtcdServer) -> None:
    params = rdzv_params(etcd_server_v3only.endpoint, "rounds", secret_file=_secret(tmp_path), **FAST)
    handler = get_rendezvous_handler(params)
    raw = raw_client(etcd_server_v3only)
    key = f"/torchelastic/v3/{params.run_id}/state"
    assert handler.next_rendezvous().rank == 0
    after_first = raw.get(key)[0]
    handler.next_rendezvous()  # round N+1: torch's compare-and-set writes, sealed with their lineage
    assert handler.num_nodes_waiting() == 0
    second = get_rendezvous_handler(params)  # another agent (or this one restarted) reads the same state
    assert second.num_nodes_waiting() == 0
    raw.put(key, after_first)
    for node in (handler, second):
        with pytest.raises(RendezvousStateError, match="replay"):
            node.num_nodes_waiting()
        compat.stop_heartbeats(node)  # no keep-alive timer outlives the test's etcd


def test_an_older_store_value_written_back_is_ignored(tmp_path, etcd_server_v3only: EtcdServer, capsys) -> None:
    _, store = create_backend(rdzv_params(etcd_server_v3only.endpoint, "store-replay", secret_file=_secret(tmp_path)))
    raw, key = raw_client(etcd_server_v3only), store.prefix + "counter"
    assert store.add("counter", 1) == 1
    old = raw.get(key)[0]
    assert store.add("counter", 1) == 2
    raw.put(key, old)  # the attacker puts the sealed "1" back: its HMAC still verifies for that key
    assert not store.check(["counter"]), "an older value written back counts as absent"
    assert "a replay" in capsys.readouterr().err
    store.set("counter", "7")  # the job's next write goes over it
    assert store.get("counter") == b"7"


class _Agents:
    """Three agents' beacons (A, B, C) of one job on a real etcd, as the backend runs them."""

    def __init__(self, server: EtcdServer, secret: bytes) -> None:
        self.client = EtcdV3Client(EtcdConnectionSpec.parse(server.endpoint))
        self.live = {n: PeerLiveness(self.client, LeaseKeeper(self.client, 0), None, "cut", secret) for n in "ABC"}
        for name, live in self.live.items():
            live.publish(name)
        self.key = run_key(None, "cut", "probe") + "/A"

    def close(self) -> None:
        for live in self.live.values():
            live.close()
        self.client.close()


def test_a_report_written_back_after_the_cut_healed_is_ignored(tmp_path, etcd_server_v3only: EtcdServer) -> None:
    """The attacker can write the job's etcd keys (the job credential) but has no secret."""
    secret = b"s" * 32
    agents, raw = _Agents(etcd_server_v3only, secret), raw_client(etcd_server_v3only)
    a, c = agents.live["A"], agents.live["C"]
    try:
        a._note_unreachable({"B"})  # the cut: A cannot reach B and publishes it with its beacon
        cut_report = raw.get(agents.key)[0]
        assert c.read_reports() and c.reports["A"] == {"B"} and losing_side("ABC", c.reports) == {"B"}
        a._note_unreachable(set())  # healed: A's report is empty again
        raw.put(agents.key, cut_report)  # ... and the attacker writes the old report back
        assert verified(secret, agents.key, cut_report), "the HMAC alone would admit it: same key, same secret"
        c.read_reports()
        assert "A" not in c.reports and losing_side("ABC", c.reports) == set(), "observer C ignores it"
        a.read_reports()  # A's next look finds its key not holding what it wrote, and writes it again
        assert raw.get(agents.key)[0] != cut_report
        c.read_reports()
        assert c.reports["A"] == frozenset() and losing_side("ABC", c.reports) == set()
        # Deleted, then a report that was the key's very first value written back: etcd's metadata fits
        # it (version 1), but C has seen later values of that key.
        raw.delete(agents.key)
        a._note_unreachable({"B"})  # publishes anew: the key's first value
        first = raw.get(agents.key)[0]
        a._note_unreachable(set())
        c.read_reports()
        raw.delete(agents.key)
        raw.put(agents.key, first)
        c.read_reports()
        assert "A" not in c.reports and losing_side("ABC", c.reports) == set()
    finally:
        agents.close()
