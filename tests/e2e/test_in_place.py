"""In-place rounds under real torchrun: at every membership change the survivors keep their process (model,
optimizer, data, RNG) and rebuild only their process groups, and the job ends bit for bit where an
uninterrupted one does.

Two real nodes (min 2: the world stays 2, so the weights can be compared to the last bit), real etcd, real
signals: a node killed, its agent or every process of it sent SIGTERM, a peer lost inside the gradient all-
reduce, a peer lost while the group forms, and a fallback forced by a failing teardown (then the fresh start of
old runs instead). A replacement node joins where one left. Each run redoes at most one step, its sample log
replays the plan, and its final state equals the uninterrupted run's to the last bit.

    python -m pytest -q tests/e2e/test_in_place.py
"""

from __future__ import annotations

import signal

import pytest
from test_precision import assert_same_state

from e2e.job import Job
from elastic_mnist import procs
from elastic_mnist.data.mnist import BatchPlan
from elastic_mnist.etcd.server import EtcdServer
from elastic_mnist.runlog import read_records
from elastic_mnist.state import format as checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS, AT, BATCH = 36, 12, 64
STATE = ("model", "optimizer", "scheduler", "scaler", "rng")


def _job(tmp_path, data: str, endpoint: str, **kw) -> Job:
    return Job(tmp_path, data, endpoint, "etcd-v3", STEPS, f"--global-batch-size={BATCH}", "--peer-timeout=3",
               "--min-step-time=0.15", nodes=2, min_nodes=2, **kw)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, small_mnist) -> dict:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    with EtcdServer(enable_v2=False) as etcd:
        job = _job(tmp, small_mnist, etcd.endpoint)
        try:
            job.start()
            job.finish()
        finally:
            job.kill_all()
    return checkpoint.load_latest(str(tmp / "ckpt"))[0]


def _kill(job: Job) -> None:
    procs.signal_tree(job.agents[1].pid, signal.SIGKILL)


def _term_agent(job: Job) -> None:
    job.agents[1].send_signal(signal.SIGTERM)


def _term_all(job: Job) -> None:
    procs.signal_tree(job.agents[1].pid, signal.SIGTERM)


FAULTS = {  # how node 1 goes, and the environment of each node's processes
    "kill": (_kill, {}),
    "term-agent": (_term_agent, {}),
    "term-all": (_term_all, {}),
    "peer-lost-in-allreduce": (None, {1: {"ELASTIC_MNIST_FAULT": f"kill:rank=1:step={AT}:at=data"}}),
    "fallback": (_term_agent, {0: {"ELASTIC_MNIST_FAULT": f"fail:step={AT}:at=teardown"}}),
}


@pytest.mark.parametrize("name", FAULTS)
def test_survivors_keep_their_process_and_end_bit_for_bit(tmp_path, small_mnist, etcd_server_v3only, uninterrupted,
                                                          name):
    fault, node_env = FAULTS[name]
    job = _job(tmp_path, small_mnist, etcd_server_v3only.endpoint)
    job.node_env = node_env
    try:
        job.start()
        procs.wait_for(lambda: job.latest_step() >= AT, 240, f"step {AT}")
        survivor = next(r["pid"] for r in read_records(str(tmp_path / "samples")) if r["rank"] == 0)
        if fault is not None:
            fault(job)
            job.start_node(1)  # a replacement where the node left (min nodes 2)
        ends = [job.agents[0], job.agents[-1]]
        assert [a.wait(timeout=300) for a in ends] == [0, 0], job.logs()
        assert job.redone_steps() <= 1, job.logs()
        _assert_replays_plan(tmp_path)
        in_place = [e for e in job.events("resume") if e.get("in_place") and e["pid"] == survivor]
        fallbacks = job.events("fallback")
        if name == "fallback":
            assert len(fallbacks) == 1 and "teardown failed" in fallbacks[0]["reason"], job.logs()
        else:
            assert in_place and not fallbacks, "the survivor went on in its own process"
        assert_same_state(uninterrupted, checkpoint.load_latest(str(tmp_path / "ckpt"))[0], keys=STATE)
        assert not procs.alive(survivor) and not [p for a in job.agents for p in procs.descendants(a.pid)]
    finally:
        job.kill_all()


def test_a_peer_lost_while_the_group_forms_costs_the_survivor_only_that_round(tmp_path, small_mnist,
                                                                            etcd_server_v3only, uninterrupted):
    """Node 1's worker dies inside the first round's muster, where rank 0 waits for it: node 0's worker, asked
    to stop there, keeps its process (its pid trains every step) and no fallback is journaled."""
    job = _job(tmp_path, small_mnist, etcd_server_v3only.endpoint)
    job.node_env = {1: {"ELASTIC_MNIST_FAULT": "kill:rank=1:round=0:at=muster"}}
    try:
        job.start()
        assert [a.wait(timeout=300) for a in job.agents] == [0, 0], job.logs()
        assert "[fault] kill at round 0 (muster)" in job.logs()
        given_up = [e for e in job.events("round_not_formed") if e["rank"] == 0]  # rank 0 mustered, 1 died
        trained_by = {r["pid"] for r in read_records(str(tmp_path / "samples")) if r["rank"] == 0}
        assert given_up and given_up[0]["kept"] and trained_by == {given_up[0]["pid"]}, job.logs()
        assert not job.events("fallback") and job.redone_steps() == 0, job.logs()
        _assert_replays_plan(tmp_path)
        assert_same_state(uninterrupted, checkpoint.load_latest(str(tmp_path / "ckpt"))[0], keys=STATE)
    finally:
        job.kill_all()


def _assert_replays_plan(tmp_path) -> None:
    """Every step of the plan trained by a full world-2 group, each rank on its share of the global batch."""
    plan, ranks = BatchPlan(2000, BATCH, seed=0), {}
    for r in read_records(str(tmp_path / "samples")):
        assert r["indices"] == plan.rank_indices(r["step"], r["world_size"], r["rank"]).tolist()
        assert r["world_size"] == 2, "min nodes 2: never trained alone"
        ranks.setdefault(r["step"], set()).add(r["rank"])
    assert sorted(ranks) == list(range(STEPS)) and all(len(v) >= 1 for v in ranks.values())
