"""A torchrun agent that dies is a graceful stop for its workers: they agree on a stop with the group,
save the last completed step and exit, so a restarted job redoes nothing.

Real etcd, two real torchrun nodes, real SIGKILL. Periodic checkpoints and snapshots are off, so any
resume point but the step the group stopped at shows up as redone steps in the sample logs.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter

import pytest

from elastic_mnist import checkpoint, procs, torchrun_settings
from elastic_mnist.etcd_server import EtcdServer
from elastic_mnist.runlog import read_records

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_STEPS = 90


class Job:
    """Two torchrun nodes of one elastic job; `start()` again is what a kubelet does after a crash."""

    def __init__(self, tmp_path, data_dir: str, etcd: EtcdServer, backend: str):
        self.tmp, self.etcd, self.backend = tmp_path, etcd, backend
        self.run_id = f"pdeath-{os.getpid()}-{backend}"
        self.train_args = [
            f"--data-dir={data_dir}", f"--checkpoint-dir={tmp_path / 'ckpt'}", f"--log-dir={tmp_path / 'runs'}",
            f"--sample-log={tmp_path / 'samples'}", f"--max-steps={MAX_STEPS}", "--checkpoint-every=0",
            "--snapshot-every=0", "--min-step-time=0.1", "--log-every=10", "--collective-timeout=30"]
        self.agents: list[subprocess.Popen] = []

    def start(self) -> None:
        targs = torchrun_settings.torchrun_args(self.backend, self.etcd.endpoint, self.run_id, 2, 2)
        for i in range(2):
            log = open(self.tmp / f"node{i}-{len(self.agents)}.log", "wb")
            self.agents.append(subprocess.Popen(procs.torchrun_command(targs, self.train_args), stdout=log,
                                                stderr=subprocess.STDOUT, env=procs.child_env(),
                                                start_new_session=True, preexec_fn=procs.die_with_parent_preexec()))
            log.close()

    def latest_step(self) -> int:
        return max((r["step"] for r in read_records(str(self.tmp / "samples"))), default=-1)

    def workers(self) -> list[int]:
        return [pid for a in self.agents[-2:] for pid in procs.descendants(a.pid) if pid != a.pid]

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(self.tmp.glob("node*.log")))

    def kill_all(self) -> None:
        for a in self.agents:
            for pid in procs.descendants(a.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            a.wait()


def _redone_steps(sample_dir: str) -> int:
    """Steps that rank 0 trained more than once (one record per step per worker process)."""
    counts = Counter(r["step"] for r in read_records(sample_dir) if r["rank"] == 0)
    assert sorted(counts) == list(range(MAX_STEPS)), "every step of the plan was trained"
    return sum(n - 1 for n in counts.values())


def _finish(job: Job) -> None:
    for a in job.agents[-2:]:
        assert a.wait(timeout=300) == 0, job.logs()
    assert checkpoint.read_finished(str(job.tmp / "ckpt"))["step"] == MAX_STEPS


def _wait_workers_gone(job: Job, workers: list[int]) -> None:
    for pid in workers:
        assert procs.wait_exit(pid, 90), f"worker {pid} outlived its agent\n{job.logs()}"


def test_all_agents_killed_at_once_lose_no_step(tmp_path, mnist_root, etcd_server_v3only):
    job = Job(tmp_path, mnist_root[0], etcd_server_v3only, "etcd-v3")
    try:
        job.start()
        procs.wait_for(lambda: job.latest_step() >= 25, 240, "step 25")
        workers = job.workers()
        for a in job.agents:  # the agents only: their workers see it through the parent-death signal
            a.send_signal(signal.SIGKILL)
        _wait_workers_gone(job, workers)
        stopped_at = job.latest_step() + 1
        assert checkpoint.list_checkpoints(str(tmp_path / "ckpt"))[0][0] == stopped_at, job.logs()
        job.start()
        _finish(job)
        assert _redone_steps(str(tmp_path / "samples")) == 0
    finally:
        job.kill_all()


def test_etcd_outage_on_the_legacy_backend_loses_no_step(tmp_path, mnist_root, etcd_server):
    """torch's legacy etcd agent exits when etcd is unreachable; its workers stop and save, and agents
    started again once etcd is back (as a kubelet restarts a container) resume at that step."""
    job = Job(tmp_path, mnist_root[0], etcd_server, "etcd")
    try:
        job.start()
        procs.wait_for(lambda: job.latest_step() >= 25, 240, "step 25")
        workers = job.workers()
        etcd_server.stop()
        for a in job.agents:
            assert a.wait(timeout=60) != 0, "the legacy agent exits while etcd is unreachable"
        _wait_workers_gone(job, workers)
        stopped_at = job.latest_step() + 1
        assert checkpoint.list_checkpoints(str(tmp_path / "ckpt"))[0][0] == stopped_at, job.logs()
        etcd_server.restart()
        job.start()
        _finish(job)
        assert _redone_steps(str(tmp_path / "samples")) == 0
    finally:
        job.kill_all()
