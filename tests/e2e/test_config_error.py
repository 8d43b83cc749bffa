"""A configuration error ends the job once, everywhere: a flag every worker refuses (here a global batch larger
than the data set, found only once the data is loaded) ends every torchrun agent of the job within seconds with
the worker's own line and exit 78, instead of --max-restarts (100) worker starts on every node; an agent
started later ends at once with the same line.

    python -m pytest -q tests/e2e/test_config_error.py
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import REPO, worker_env

from e2e.job import Job
from elastic_mnist import procs
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract import torchrun as torchrun_settings
from elastic_mnist.etcd.rdzv_status import read_rendezvous_status
from elastic_mnist.ops.status import render

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LINE = "--global-batch-size 5000 is larger than the training set (2000 samples)"


def test_a_worker_config_error_ends_every_agent_once_with_its_line(tmp_path, small_mnist, etcd_server_v3only):
    job = Job(tmp_path, small_mnist, etcd_server_v3only.endpoint, "etcd-v3", 20, "--global-batch-size=5000")
    try:
        started = time.monotonic()
        job.start()
        codes = [a.wait(timeout=120) for a in job.agents]
        took = time.monotonic() - started
        logs = job.logs()
        assert codes == [exit_codes.PERMANENT] * 2, logs
        assert took < 60, f"ended after {took:.0f}s"
        for i in range(2):
            log = (tmp_path / f"node{i}-{i}.log").read_text()
            assert LINE in log and log.count("elastic-mnist train: error:") <= 1, log[-3000:]
            assert "a configuration error ended the job" in log, log[-3000:]
        # A node started afterwards (a kubelet's restart, a late joiner) ends at once with the same line.
        targs = torchrun_settings.torchrun_args("etcd-v3", etcd_server_v3only.endpoint, job.run_id, 1, 2)
        late = subprocess.run(procs.torchrun_command(targs, job.train_args), capture_output=True, text=True,
                              timeout=60, env=procs.child_env())
        assert late.returncode == exit_codes.PERMANENT and LINE in late.stderr, late.stderr[-2000:]
        assert "elastic-mnist train" not in late.stderr, "no worker started"
        status = read_rendezvous_status(etcd_server_v3only.endpoint, job.run_id)
        assert status["phase"] == "closed" and LINE in status["config_error"], status  # `elastic-mnist status` too
        assert f"ended on a configuration error: {LINE}" in render(status)
    finally:
        job.kill_all()


def test_local_ends_with_the_workers_own_line(tmp_path, small_mnist):
    cmd = [sys.executable, "-m", "elastic_mnist", "local", "--nodes", "2", "--run-dir", str(tmp_path / "run"),
           "--data-dir", small_mnist, "--global-batch-size", "5000", "--timeout", "120"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=worker_env(), cwd=REPO)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == exit_codes.PERMANENT, run.stdout[-2000:] + run.stderr[-2000:]
    assert last.startswith("elastic-mnist local: error: the job ended on a configuration error") and LINE in last, last
