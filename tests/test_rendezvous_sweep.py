"""A finished round's keys leave etcd: what torch's agent writes for each round (roles, ranks, rank 0's
address) is deleted by a later round's rank 0, so a run of hundreds of rounds keeps a few rounds' keys.
Real etcd, the real store, torch's per-round prefix."""

from __future__ import annotations

from etcd_fixtures import rdzv_params
from torch.distributed import PrefixStore

from elastic_mnist._torch_compat import round_store_prefix
from elastic_mnist.rendezvous import create_backend
from elastic_mnist.rendezvous._sweep import KEEP_ROUNDS, sweep


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
