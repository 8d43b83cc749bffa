"""Real torchrun: 2 workers train and stop, 1 worker resumes at that step; the sample logs together
replay the uninterrupted global batches. And the issue's acceptance run at world size 2."""

import json

from conftest import run_torchrun
from elastic_mnist.data import BatchPlan
from elastic_mnist.runlog import read_records


def _train_args(data: str, tmp, *extra: str) -> list[str]:
    return ["--data-dir", data, "--checkpoint-dir", str(tmp / "ckpt"), "--log-dir", str(tmp / "runs"),
            "--sample-log", str(tmp / "samples"), "--global-batch-size", "48", "--checkpoint-every", "5", *extra]


def test_two_workers_then_one_worker_resume_in_the_uninterrupted_order(small_mnist, tmp_path):
    two = run_torchrun(["--standalone", "--nproc-per-node=2"], _train_args(small_mnist, tmp_path, "--max-steps", "7"))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one = run_torchrun(["--standalone", "--nproc-per-node=1"], _train_args(small_mnist, tmp_path, "--max-steps", "15"))
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "[resume] step 7 (epoch 0, position 7)" in one.stdout and "saved at world size 2; now world size 1" in one.stdout

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


def test_a_worker_never_outlives_its_agent(small_mnist, tmp_path):
    """SIGKILL of the torchrun agent alone (workers run in their own sessions) still ends the worker."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO, worker_env
    from elastic_mnist.procs import alive, children

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m",
           "elastic_mnist.train", "--data-dir", small_mnist, "--max-steps", "100000", "--min-step-time", "0.05",
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "runs")]
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=worker_env(),
                             cwd=REPO, start_new_session=True)
    try:
        for line in agent.stdout:  # a real step, not a sleep
            if "[first-step]" in line:
                break
        (worker,) = children()[agent.pid]
        assert os.getsid(worker) != os.getsid(agent.pid), "torchrun starts workers in their own session"
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the outcome, bounded
        assert not alive(worker), "the worker died with its agent"
    finally:
        if agent.poll() is None:
            agent.kill()
