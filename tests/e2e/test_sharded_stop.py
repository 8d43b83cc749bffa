"""A sharded job (--parallel fsdp) stopped whole loses nothing: no rank holds the whole state, so when every
node is asked to stop the ranks save together before they leave, also when the nodes' SIGTERMs come apart
(a node asked first trains on for up to --stop-wait, to see whether the others follow).

    flock /tmp/em-heavy.lock pytest -q tests/e2e/test_sharded_stop.py

Real etcd, two real torchrun nodes (etcd-v3, rounds in place), real SIGTERMs to the agents. Periodic
checkpoints and snapshots are off, so a step the stop itself did not save shows up.
"""

from __future__ import annotations

import signal
import subprocess

import pytest

from e2e.job import Job
from elastic_mnist import procs
from elastic_mnist.runlog import read_records

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _steps(job: Job, after: int = -1) -> list[int]:
    return [r["step"] for r in read_records(str(job.tmp / "samples")) if r["world_size"] == 2 and r["step"] > after]


def _stop_all(job: Job, staggered: bool, after: int = -1) -> int:
    """SIGTERM both agents (b first, then a once b's worker waits for the rest); the step they stopped at."""
    a, b = job.agents[-2:]
    b.send_signal(signal.SIGTERM)
    if staggered:
        procs.wait_for(lambda: job.events("stop_waits"), 60, "node b waiting to see whether the job stops")
    a.send_signal(signal.SIGTERM)
    a.wait(timeout=90)  # (torchrun exits 1 on a signal, whatever its workers did)
    b.wait(timeout=90)
    stops = [e for e in job.events("stop") if e["step"] > after]
    assert {e["rank"] for e in stops} == {0, 1} and all(e["saved_together"] for e in stops), job.logs()
    assert len({e["step"] for e in stops}) == 1, stops
    return stops[0]["step"]


def test_a_sharded_job_stopped_whole_saves_its_last_step_also_when_the_stops_come_apart(
        tmp_path, small_mnist, etcd_server_v3only):
    job = Job(tmp_path, small_mnist, etcd_server_v3only.endpoint, "etcd-v3", 10_000, "--parallel=fsdp",
              "--global-batch-size=64", "--min-step-time=0.05", "--stop-wait=10")
    try:
        job.start()
        procs.wait_for(lambda: len(_steps(job)) >= 4, 120, "both nodes training")
        stopped = _stop_all(job, staggered=True)
        assert stopped == max(_steps(job)) + 1 and job.newest_checkpoint_step() == stopped, job.logs()
        assert job.events("stop_waits"), "node b trained on while it waited"

        job.start()  # the whole job again: it resumes from the step it stopped at, then stops at once
        procs.wait_for(lambda: len(_steps(job, stopped)) >= 2, 120, "the job training again")
        assert min(_steps(job, stopped - 1)) == stopped, "resumed where the job stopped"
        again = _stop_all(job, staggered=False, after=stopped)
        assert job.newest_checkpoint_step() == again == max(_steps(job)) + 1, job.logs()
    except (TimeoutError, subprocess.TimeoutExpired):
        print(job.logs())
        raise
    finally:
        job.kill_all()
