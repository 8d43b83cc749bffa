"""A peer's departure is not this node's failure: two real nodes run the README's etcd-v3 command with
--max-restarts=3, the peer is killed (or preempted) and started again 10 times, and the survivor trains on
through all of it, its agent's restart count still 0.

    python -m pytest -q tests/e2e/test_restart_budget.py
"""

from __future__ import annotations

import signal

import pytest

from e2e.job import Job
from elastic_mnist import procs
from elastic_mnist.runlog import read_records

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CYCLES = 10


def _rank1_steps(job: Job) -> int:
    """Records of steps trained at world 2 (rank 1 exists only there): grows once the peer is back."""
    return sum(r["rank"] == 1 for r in read_records(str(job.tmp / "samples")))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "preempted"])
def test_a_peer_that_leaves_ten_times_spends_none_of_the_survivors_restarts(tmp_path, small_mnist,
                                                                          etcd_server_v3only, sig):
    job = Job(tmp_path, small_mnist, etcd_server_v3only.endpoint, "etcd-v3", 1_000_000, "--epochs=1000",
              "--global-batch-size=64",
              "--min-step-time=0.05", "--peer-timeout=3", nodes=2, min_nodes=1, max_restarts=3)
    try:
        job.start()
        together = 0
        for cycle in range(CYCLES):
            together = procs.wait_for(lambda: (n := _rank1_steps(job)) > together and n, 240,
                                      f"the peer to train in the group (cycle {cycle})")
            peer = job.agents[-1]
            procs.signal_tree(peer.pid, sig)
            peer.wait(timeout=120)
            together = _rank1_steps(job)  # a preempted peer trains on to the next step boundary first
            job.start_node(1)
        before = job.latest_step()
        procs.wait_for(lambda: job.latest_step() > before + 5, 120, "the survivor to train on after the last cycle")
        mine = set(procs.descendants(job.agents[0].pid))  # its kept worker: ranks change as pids sort
        survivor = [r for r in read_records(str(tmp_path / "samples")) if r["pid"] in mine]
        assert job.agents[0].poll() is None, job.logs()
        assert {r["restart"] for r in survivor} == {0}, "no restart of the survivor's was spent"
        # every departure is a new round for the survivor's kept worker (alone, or with the next peer already)
        rounds = [e for e in job.events("resume") if e["pid"] in mine and e.get("in_place")]
        assert len(rounds) >= CYCLES, f"the survivor's own worker served every round ({len(rounds)})"
    finally:
        job.kill_all()
