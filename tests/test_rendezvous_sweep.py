"""A finished round's keys leave etcd: what torch's agent writes for each round (roles, ranks, rank 0's
address) is deleted by a later round's rank 0, so a run of hundreds of rounds keeps a few rounds' keys.
Real etcd, the real store, torch's per-round prefix."""

from __future__ import annotations

import pickle
from datetime import datetime, timedelta, timezone

from etcd_fixtures import raw_client, rdzv_params
from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elastic_mnist.compat.private import round_store_prefix
from elastic_mnist.etcd.client import EtcdConnectionSpec, EtcdV3Client
from elastic_mnist.etcd.lease import LeaseKeeper
from elastic_mnist.rendezvous import create_backend
from elastic_mnist.rendezvous._liveness import PeerLiveness
from elastic_mnist.rendezvous._prompt import RoundView
from elastic_mnist.rendezvous._sweep import KEEP_ROUNDS, sweep, sweep_beacons

PREFIX = "/torchelastic/v3"  # the default key_prefix
N0, N1, N2, LATE = (_NodeDesc(f"10.0.0.{i}", 1, 0) for i in range(4))


def _write_round(store, run_id: str, round_: int) -> None:
    # what torch's agent writes, through the prefix torch's handler wraps the store in
    prefixed = PrefixStore(round_store_prefix(run_id, round_).rstrip("/"), store)
    for key in ("torchelastic/role_info/0", "torchelastic/assigned_ranks/0", "MASTER_ADDR", "MASTER_PORT"):
        prefixed.set(key, b"x")


def test_each_round_sweeps_what_is_two_rounds_behind_and_nothing_newer(etcd_server_v3only):
    run_id = "sweep"
    _, store = create_backend(rdzv_params(etcd_server_v3only.endpoint, run_id))
    _write_round(store, run_id, 0)
    for current in range(1, 40):  # a round forms; its rank 0 sweeps
        _write_round(store, run_id, current)
        sweep(store, run_id, current)
    store.set("elastic-mnist/fingerprint", b"kept")
    left = {r for r in range(40) if store.check([f"{round_store_prefix(run_id, r)}MASTER_ADDR"])}
    assert left == set(range(40 - KEEP_ROUNDS, 40)), left  # the current round and the one before
    assert store.num_keys() == 4 * len(left) + 1  # only those rounds' keys, and the job's own


def test_a_round_whose_rank_0_died_before_sweeping_is_swept_by_the_next(etcd_server_v3only):
    run_id = "gap"
    _, store = create_backend(rdzv_params(etcd_server_v3only.endpoint, run_id))
    for r in range(12):
        _write_round(store, run_id, r)
    for current in (2, 3, 4, 5, 9, 10, 11):  # rounds 6, 7 and 8 never swept
        sweep(store, run_id, current)
    assert not any(store.check([f"{round_store_prefix(run_id, r)}MASTER_ADDR"]) for r in range(10))


def _agent(endpoint: str, run_id: str, node: str | None = None) -> PeerLiveness:
    client = EtcdV3Client(EtcdConnectionSpec.parse(endpoint))
    agent = PeerLiveness(client, LeaseKeeper(client, 60), PREFIX, run_id, None)
    if node is not None:
        agent.publish(node)
    return agent


def _formed(view: RoundView, round_: int, beating: list[_NodeDesc]) -> None:
    """The view reads a formed round's state in which `beating` have a heartbeat (what rank 0 reads)."""
    state = _RendezvousState()
    state.round, state.complete = round_, True
    state.participants = {node: rank for rank, node in enumerate(beating)}
    state.last_heartbeats = dict.fromkeys(beating, datetime.now(timezone.utc))
    view(pickle.dumps(state))


def _beacon_names(server, run_id: str) -> set[str]:
    client = raw_client(server)
    try:
        return {meta.key.decode().rsplit("/", 1)[1] for _, meta in client.get_prefix(f"{PREFIX}/{run_id}/probe/")}
    finally:
        client.close()


def test_a_vanished_nodes_beacon_goes_two_rounds_after_its_heartbeat_and_a_live_ones_stays(etcd_server_v3only):
    """A vanished host's agent takes its beacon key nowhere and nobody is refused by it: rank 0 of a later
    round removes it. A node still beating, a joiner's key written since, and rank 0's own stay."""
    run_id, endpoint = "beacons", etcd_server_v3only.endpoint
    rank0, live, vanished = (_agent(endpoint, run_id, str(n)) for n in (N0, N1, N2))
    _agent(endpoint, run_id, str(LATE))  # published, not yet in the state (a joiner on its way in)
    view = RoundView(timedelta(seconds=0), rank0)
    names = lambda: _beacon_names(etcd_server_v3only, run_id)  # noqa: E731
    _formed(view, 5, [N0, N1])
    sweep_beacons(view, 5)
    assert names() == {str(n) for n in (N0, N1, N2, LATE)}, "seen gone once: kept"
    vanished._beacon.close()  # noqa: SLF001 - the host is gone; its key stays behind
    _agent(endpoint, run_id, str(LATE))  # the joiner wrote its key again meanwhile
    _formed(view, 6, [N0, N1])
    sweep_beacons(view, 6)
    assert names() == {str(n) for n in (N0, N1, LATE)}, "gone over two rounds: removed; rewritten since: kept"
    waiting = RoundView(timedelta(hours=1), _agent(endpoint, run_id))
    for round_ in (7, 8):
        _formed(waiting, round_, [N0])
        sweep_beacons(waiting, round_)
    assert names() == {str(n) for n in (N0, N1, LATE)}, "not gone for the keep-alive window yet: kept"
    live.close()
