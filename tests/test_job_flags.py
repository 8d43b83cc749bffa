"""Every node of a job trains with one configuration (elastic_mnist/rendezvous/_flags.py): the flags that differ
are named, the first node's fingerprint in the job's store is the job's, and a node with other flags is refused.

    python -m pytest -q tests/test_job_flags.py

(tests/e2e/test_one_node.py refuses a real torchrun node with another --lr while the job trains on.)
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from etcd_fixtures import rdzv_params

from elastic_mnist.config import FINGERPRINT_BEFORE, parse_args
from elastic_mnist.contract.warm import WorkerPlan
from elastic_mnist.rendezvous import _flags as job_flags
from elastic_mnist.rendezvous.etcd_v3 import create_backend
from elastic_mnist.rendezvous.policy import AgentPolicy


def _plan(*args: str, module: str = "elastic_mnist.train") -> WorkerPlan:
    return WorkerPlan({"module": module}, list(args), ".", 1)


def test_the_differing_flags_are_named_with_both_values():
    job = parse_args([]).fingerprint()
    mine = parse_args(["--lr", "0.5", "--seed", "7", "--epochs", "3"]).fingerprint()  # --epochs: not a fingerprint
    assert job_flags.differing(mine, job) == ["--lr 0.5 (the job: 0.001)", "--seed 7 (the job: 0)"]
    assert job_flags.differing(job, dict(job)) == []
    assert job_flags.differing({**job, "new": 1}, job) == ["--new 1 (the job: not set)"]


def test_the_fingerprint_is_the_workers_resolved_flags_for_this_packages_worker_only():
    resolved = parse_args(["--hidden", "64"]).fingerprint()
    assert job_flags.of_plan(_plan("--hidden=64")) == {**resolved, "parallel": "ddp"}
    sharded = job_flags.of_plan(_plan("--parallel=fsdp"))
    assert job_flags.differing(sharded, job_flags.of_plan(_plan())) == ["--parallel fsdp (the job: ddp)"]
    job_before = parse_args([]).fingerprint()  # a job started by a version without the flag trains replicated
    assert job_flags.differing(sharded, job_before) == ["--parallel fsdp (the job: ddp)"]
    assert job_flags.of_plan(_plan("--hidden=64", module="my_trainer")) is None, "not ours: not checked here"
    assert job_flags.of_plan(_plan("--hidden=-1")) is None, "refused flags: the flag check says so itself"
    assert job_flags.of_plan(None) is None


def test_the_first_node_defines_the_job_and_another_configuration_is_refused(etcd_server_v3only):
    backend, store = create_backend(rdzv_params(etcd_server_v3only.endpoint, run_id="job-a"))
    try:
        first, other = parse_args([]).fingerprint(), parse_args(["--hidden", "64"]).fingerprint()
        assert job_flags.refusal(store, first, "job-a") == ""
        assert job_flags.refusal(store, dict(first), "job-a") == "", "the same flags join, again and again"
        line = job_flags.refusal(store, other, "job-a")
        assert line.startswith("this node's flags differ from those job job-a trains with: --hidden 64 (the job: "
                               "512); start this node with the job's flags"), line
        assert "\n" not in line and "new --rdzv-id" in line
        assert job_flags.refusal(store, first, "job-a") == "", "a refused node changed nothing"
        older = {k: v for k, v in first.items() if k not in FINGERPRINT_BEFORE}
        store.set(job_flags.FINGERPRINT_KEY, json.dumps(older, sort_keys=True))  # a job that began before a flag
        assert job_flags.refusal(store, first, "job-a") == "", "a newer node at the flag's former value joins"
        assert "--hidden-layers 2 (the job: 1)" in job_flags.refusal(store, {**first, "hidden_layers": 2}, "job-a")
        store.set(job_flags.FINGERPRINT_KEY, "not json")
        assert "is not one this runtime wrote" in job_flags.refusal(store, first, "job-a")
    finally:
        backend.client.close()


def test_every_rendezvous_of_the_job_writes_its_configuration_again(etcd_server_v3only):
    """The key carries its last writer's lease: each agent of the job writes it again before it rendezvous, so
    it outlives the node that defined it (here: gone, as when that node's lease expired)."""
    backend, store = create_backend(rdzv_params(etcd_server_v3only.endpoint, run_id="job-b"))
    try:
        mine, joined = parse_args([]).fingerprint(), []
        handler = SimpleNamespace(next_rendezvous=lambda: joined.append(1) or "round", num_nodes_waiting=lambda: 0,
                                  shutdown=lambda: True)
        AgentPolicy(handler).add("flags", job_flags.keep_the_job_flags(store, mine)).install()
        assert job_flags.refusal(store, mine, "job-b") == ""
        store.delete_key(job_flags.FINGERPRINT_KEY)
        assert handler.next_rendezvous() == "round" and joined == [1]
        assert job_flags.refusal(store, parse_args(["--seed", "7"]).fingerprint(), "job-b").startswith(
            "this node's flags differ from those job job-b trains with: --seed 7 (the job: 0)")
    finally:
        backend.client.close()
