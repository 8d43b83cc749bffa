"""A torchrun agent that dies is a graceful stop for its workers: they agree on a stop with the group,
save the last completed step and exit, so a restarted job redoes nothing.

Real etcd, two real torchrun nodes, real SIGKILL. Periodic checkpoints and snapshots are off, so any
resume point but the step the group stopped at shows up as redone steps in the sample logs.
"""

from __future__ import annotations

import signal

import pytest

from e2e.job import Job
from elastic_mnist import procs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_STEPS = 90


def _wait_workers_gone(job: Job, workers: list[int]) -> None:
    for pid in workers:
        assert procs.wait_exit(pid, 90), f"worker {pid} outlived its agent\n{job.logs()}"


def test_all_agents_killed_at_once_lose_no_step(tmp_path, mnist_root, etcd_server_v3only):
    job = Job(tmp_path, mnist_root[0], etcd_server_v3only.endpoint, "etcd-v3", MAX_STEPS)
    try:
        job.start()
        procs.wait_for(lambda: job.latest_step() >= 25, 240, "step 25")
        workers = job.workers()
        for a in job.agents:  # the agents only: their workers see it through the parent-death signal
            a.send_signal(signal.SIGKILL)
        _wait_workers_gone(job, workers)
        stopped_at = job.latest_step() + 1
        assert job.newest_checkpoint_step() == stopped_at, job.logs()
        job.start()
        job.finish()
        assert job.redone_steps() == 0
    finally:
        job.kill_all()


def test_etcd_outage_on_the_legacy_backend_loses_no_step(tmp_path, mnist_root, etcd_server):
    """torch's legacy etcd agent exits when etcd is unreachable; its workers stop and save, and agents
    started again once etcd is back (as a kubelet restarts a container) resume at that step."""
    job = Job(tmp_path, mnist_root[0], etcd_server.endpoint, "etcd", MAX_STEPS)
    try:
        job.start()
        procs.wait_for(lambda: job.latest_step() >= 25, 240, "step 25")
        workers = job.workers()
        etcd_server.stop()
        for a in job.agents:
            assert a.wait(timeout=60) != 0, "the legacy agent exits while etcd is unreachable"
        _wait_workers_gone(job, workers)
        stopped_at = job.latest_step() + 1
        assert job.newest_checkpoint_step() == stopped_at, job.logs()
        etcd_server.restart()
        job.start()
        job.finish()
        assert job.redone_steps() == 0
    finally:
        job.kill_all()
