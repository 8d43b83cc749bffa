"""Real torchrun: 2 workers train and stop, 1 worker resumes at that step; the sample logs together
replay the uninterrupted global batches. The acceptance run at world size 2, and a worker whose agent
dies."""

import json
import os
import signal
import subprocess

import pytest
from conftest import REPO, run_torchrun

from elastic_mnist import procs
from elastic_mnist.data.mnist import BatchPlan
from elastic_mnist.runlog import read_records
from elastic_mnist.state import format as checkpoint

pytestmark = pytest.mark.slow  # real worker processes: the full suite runs them, the fast tier skips them


def _train_args(data: str, tmp, *extra: str) -> list[str]:
    return ["--data-dir", data, "--checkpoint-dir", str(tmp / "ckpt"), "--log-dir", str(tmp / "runs"),
            "--sample-log", str(tmp / "samples"), "--global-batch-size", "48", "--checkpoint-every", "5", *extra]


def test_two_workers_then_one_worker_resume_in_the_uninterrupted_order(small_mnist, tmp_path):
    two = run_torchrun(["--standalone", "--nproc-per-node=2"], _train_args(small_mnist, tmp_path, "--max-steps", "7"))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one = run_torchrun(["--standalone", "--nproc-per-node=1"], _train_args(small_mnist, tmp_path, "--max-steps", "15"))
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert ("[resume] step 7 (epoch 0, position 7)" in one.stdout
            and "saved at world size 2; now world size 1" in one.stdout)

    records = read_records(str(tmp_path / "samples"))
    plan = BatchPlan(2000, 48, seed=0)
    for step in range(15):
        at_step = sorted((r for r in records if r["step"] == step), key=lambda r: r["rank"])
        assert [r["world_size"] for r in at_step] == ([2, 2] if step < 7 else [1])
        union = [i for r in at_step for i in r["indices"]]
        assert union == plan.global_indices(step).tolist(), f"step {step}"
    assert json.loads((tmp_path / "runs" / "summary.json").read_text())["global_step"] == 15


def test_two_workers_one_epoch_reach_96_percent(mnist_root, tmp_path):
    root, real = mnist_root
    run = run_torchrun(["--standalone", "--nnodes=1", "--nproc-per-node=2"],
                       ["--data-dir", root, "--epochs", "1", "--checkpoint-dir", str(tmp_path / "ckpt"),
                        "--log-dir", str(tmp_path / "runs")])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs_completed"] == 1
    assert summary["test_accuracy"] >= (0.96 if real else 0.95)


def test_a_worker_never_outlives_its_agent_and_saves_on_the_way_out(small_mnist, tmp_path):
    """SIGKILL of the torchrun agent alone (workers run in their own sessions): the worker gets the
    parent-death signal, stops at the next step boundary, saves that step and exits."""
    cmd = procs.torchrun_command(["--standalone", "--nproc-per-node=1"], [
        "--data-dir", small_mnist, "--max-steps", "100000", "--min-step-time", "0.05", "--checkpoint-every", "0",
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "runs"),
        "--sample-log", str(tmp_path / "samples"),
        # a worker stopped by its agent's death keeps its snapshots for a restart: this test's own memory
        "--snapshot-dir", str(tmp_path / "shm")])
    log = open(tmp_path / "agent.log", "wb")
    agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=procs.child_env(), cwd=REPO,
                             start_new_session=True)
    log.close()
    try:
        procs.wait_for(lambda: read_records(str(tmp_path / "samples")), 120, "the first step")
        (worker,) = procs.children()[agent.pid]
        assert os.getsid(worker) != os.getsid(agent.pid), "torchrun starts workers in their own session"
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        assert procs.wait_exit(worker, 30), "the worker left after its agent died"
        last = max(r["step"] for r in read_records(str(tmp_path / "samples")))
        assert checkpoint.list_checkpoints(str(tmp_path / "ckpt"))[0][0] == last + 1, "the stop step was saved"
    finally:
        if agent.poll() is None:
            agent.kill()
