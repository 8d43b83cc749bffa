"""Real torchrun: 2 workers train and stop, 1 worker resumes at that step; the sample logs together
replay the uninterrupted global batches. And the issue's acceptance run at world size 2."""

import json

from conftest import run_torchrun
from elastic_mnist.data import BatchPlan, read_sample_logs


def _train_args(data: str, tmp, *extra: str) -> list[str]:
    return ["--data-dir", data, "--checkpoint-dir", str(tmp / "ckpt"), "--log-dir", str(tmp / "runs"),
            "--sample-log", str(tmp / "samples"), "--global-batch-size", "48", "--checkpoint-every", "5", *extra]


def test_two_workers_then_one_worker_resume_in_the_uninterrupted_order(small_mnist, tmp_path):
    two = run_torchrun(["--standalone", "--nproc-per-node=2"], _train_args(small_mnist, tmp_path, "--max-steps", "7"))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one = run_torchrun(["--standalone", "--nproc-per-node=1"], _train_args(small_mnist, tmp_path, "--max-steps", "15"))
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "[resume] step 7 (epoch 0, position 7)" in one.stdout and "saved at world size 2; now world size 1" in one.stdout

    records = read_sample_logs(str(tmp_path / "samples"))
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
