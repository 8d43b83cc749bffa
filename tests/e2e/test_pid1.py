"""torchrun as PID 1 (a container's entrypoint: `docker run IMAGE torchrun ...`, Kubeflow's PyTorchJob) trains:
a worker whose agent is PID 1 is not taken for an orphan. A pid namespace (`unshare -pf`) makes torchrun
PID 1 here, cold (torch's c10d backend, no help from our agent) and warm (the etcd-v3 backend).

    python -m pytest -q tests/e2e/test_pid1.py
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from conftest import REPO

from elastic_mnist import procs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _train_as_pid1(tmp_path, data: str, torchrun_args: list[str]) -> subprocess.CompletedProcess:
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed: apt-get install util-linux")
    train = [f"--data-dir={data}", f"--checkpoint-dir={tmp_path / 'ckpt'}", f"--log-dir={tmp_path / 'runs'}",
             "--max-steps=6", "--snapshot-every=0"]
    # The probe prints its own pid from inside the namespace before it execs torchrun: it must be 1.
    command = ["sh", "-c", 'echo "pid $$" && exec "$@"', "sh",
               *procs.torchrun_command(["--nproc-per-node=1", "--max-restarts=0", *torchrun_args], train)]
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", *command], capture_output=True, text=True,
                          timeout=300, env=procs.child_env(), cwd=REPO)


def _assert_trained(done: subprocess.CompletedProcess, tmp_path) -> None:
    assert done.stdout.startswith("pid 1\n"), done.stdout[:200]
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "runs" / "summary.json").read_text())["global_step"] == 6


def test_a_cold_worker_under_torchrun_as_pid1_trains(tmp_path, small_mnist):
    _assert_trained(_train_as_pid1(tmp_path, small_mnist, ["--standalone", "--rdzv-id=pid1-cold"]), tmp_path)


def test_a_warm_worker_under_torchrun_as_pid1_trains(tmp_path, small_mnist, etcd_server_v3only):
    done = _train_as_pid1(tmp_path, small_mnist, ["--nnodes=1", "--rdzv-backend=etcd-v3", "--rdzv-id=pid1-warm",
                                                  f"--rdzv-endpoint={etcd_server_v3only.endpoint}"])
    _assert_trained(done, tmp_path)
    assert "starting cold" not in done.stderr, done.stderr[-2000:]
