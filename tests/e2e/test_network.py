"""Faults of the network between hosts, on real etcd and two real torchrun nodes: one node's clock off by
30 s (libfaketime on its whole process tree), and etcd unreachable from every node (SIGSTOPped: its port
still accepts connections, nothing answers) for longer than every etcd call's deadline.

    python -m pytest tests/e2e/test_network.py -q
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from e2e.job import Job
from elastic_mnist import procs
from elastic_mnist.runlog import read_records

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FAKETIME_LIB = next((str(p) for p in Path("/usr/lib").glob("*/faketime/libfaketime.so.1")), "")
# etcd away 40 s: 4 times read_timeout (10 s), past the keep-alive window (15 s) and past the job's
# --collective-timeout (30 s in this test), so no timer of the agents', the store's or the workers' fires unnoticed.
OUTAGE_S = float(os.environ.get("ELASTIC_MNIST_TEST_ETCD_OUTAGE_S", "40"))
OUTAGE_COLLECTIVE_TIMEOUT_S = 30


def skewed(offset_s: int) -> dict[str, str]:
    """The environment that puts a process tree's wall clock offset_s seconds off (monotonic too: harmless)."""
    assert FAKETIME_LIB, "libfaketime is not installed (apt-get install faketime)"
    return {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": f"{offset_s:+d}s", "FAKETIME_NO_CACHE": "1"}


@pytest.fixture
def faketime_files():
    """libfaketime makes /dev/shm/faketime_shm_PID and sem.faketime_sem_PID in every process it is preloaded
    into and removes them only at a normal exit; workers end with os._exit, agents may be killed. The test
    that preloads it owns what its processes left: every such file whose process is gone is removed."""
    def current() -> set[Path]:
        return set(Path("/dev/shm").glob("faketime_shm_*")) | set(Path("/dev/shm").glob("sem.faketime_sem_*"))

    before = current()
    yield
    for path in current() - before:
        if not procs.alive(int(path.name.rsplit("_", 1)[1])):
            path.unlink(missing_ok=True)


def worker_lives(job: Job) -> set[tuple[int, int]]:
    """(restart count, world size) of every worker process that trained a step: {(0, 2)} is one round."""
    lives = {(r["pid"], r["restart"], r["world_size"]) for r in read_records(str(job.tmp / "samples"))}
    assert len(lives) == 2 or any(restart for _, restart, _ in lives), f"one process per rank: {lives}"
    return {(restart, world) for _, restart, world in lives}


@pytest.mark.parametrize("offset_s", [-30, 30])
def test_a_node_whose_clock_is_30_s_off_joins_and_trains(tmp_path, small_mnist, etcd_server_v3only, offset_s,
                                                         faketime_files):
    """Round 0 needs both nodes, so the job trains at all only if the skewed node is admitted and stays."""
    job = Job(tmp_path, small_mnist, etcd_server_v3only.endpoint, "etcd-v3", 40, "--global-batch-size=64")
    job.node_env[1] = skewed(offset_s)
    try:
        job.start()
        job.finish(timeout=240)
        assert job.redone_steps() == 0
        assert worker_lives(job) == {(0, 2)}, "one round of two: the skewed node was never judged dead"
    finally:
        job.kill_all()


def test_etcd_away_longer_than_read_timeout_is_ridden_out(tmp_path, small_mnist, etcd_server_v3only):
    """Membership is stable, so training goes on while etcd is away; no agent exits, and nothing is redone
    or re-formed when etcd is back (the same workers finish the job)."""
    steps = int(OUTAGE_S / 0.1) + 150  # --min-step-time 0.1: still training when etcd comes back
    job = Job(tmp_path, small_mnist, etcd_server_v3only.endpoint, "etcd-v3", steps, "--global-batch-size=64",
              "--epochs=1000", f"--collective-timeout={OUTAGE_COLLECTIVE_TIMEOUT_S}")
    assert OUTAGE_S > OUTAGE_COLLECTIVE_TIMEOUT_S
    try:
        job.start()
        procs.wait_for(lambda: job.latest_step() >= 30, 240, "the job to train")
        etcd_pid = etcd_server_v3only.pid
        os.kill(etcd_pid, signal.SIGSTOP)
        try:
            stopped_at, step_then = time.monotonic(), job.latest_step()
            while time.monotonic() - stopped_at < OUTAGE_S:  # the outage itself: its length is the scenario
                assert all(a.poll() is None for a in job.agents), "an agent exited during the outage:\n" + job.logs()
                time.sleep(1)
            assert job.latest_step() >= step_then + OUTAGE_S / 0.1 / 4, "training went on without etcd"
        finally:
            os.kill(etcd_pid, signal.SIGCONT)
        job.finish(timeout=240 + OUTAGE_S)
        assert job.redone_steps() == 0
        assert worker_lives(job) == {(0, 2)}, "no re-rendezvous when etcd came back:\n" + job.logs()
    finally:
        job.kill_all()
