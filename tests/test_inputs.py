"""The DataLoader path (torchvision's MNIST, the seed's transforms, the elastic sampler, worker
processes) trains on exactly the batches of the in-memory path, to the last bit of the weights."""

import pytest
import torch
from conftest import run_torchrun, run_train

from elastic_mnist.data.mnist import BatchPlan
from elastic_mnist.runlog import read_records

pytestmark = pytest.mark.slow  # real worker processes: the full suite runs them, the fast tier skips them


def _args(data: str, tmp, name: str, *extra: str) -> list[str]:
    return ["--data-dir", data, "--checkpoint-dir", str(tmp / name / "ckpt"), "--log-dir", str(tmp / name / "runs"),
            "--sample-log", str(tmp / name / "samples"), "--max-steps", "24", "--global-batch-size", "64", *extra]


def test_dataloader_path_equals_the_in_memory_path(small_mnist, tmp_path):
    memory = run_train(_args(small_mnist, tmp_path, "memory"))
    assert memory.returncode == 0, memory.stderr
    loader = run_train(_args(small_mnist, tmp_path, "loader", "--input", "dataloader", "--num-workers", "2"))
    assert loader.returncode == 0, loader.stderr
    records = {name: sorted((r["step"], r["indices"]) for r in read_records(str(tmp_path / name / "samples")))
               for name in ("memory", "loader")}
    assert records["memory"] == records["loader"] and len(records["loader"]) == 24
    a, b = (torch.load(tmp_path / name / "runs" / "model.pt", weights_only=True) for name in ("memory", "loader"))
    assert all(torch.equal(a[k], b[k]) for k in a), "same batches, same values, same weights"


def test_dataloader_path_resized_mid_epoch_follows_the_plan(small_mnist, tmp_path):
    """World 2 for 10 steps, then world 3 from the checkpoint: every rank's share is the plan's."""
    common = _args(small_mnist, tmp_path, "resize", "--input", "dataloader", "--checkpoint-every", "5")
    first = run_torchrun(["--standalone", "--nproc-per-node=2"], [*common, "--max-steps", "10"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_torchrun(["--standalone", "--nproc-per-node=3"], common)
    assert second.returncode == 0, second.stderr[-3000:]
    plan = BatchPlan(2000, 64, seed=0)
    records = read_records(str(tmp_path / "resize" / "samples"))
    for r in records:
        assert r["indices"] == plan.rank_indices(r["step"], r["world_size"], r["rank"]).tolist()
    worlds = {(r["step"], r["world_size"]) for r in records}
    assert {s for s, w in worlds if w == 2} == set(range(10)) and {s for s, w in worlds if w == 3} == set(range(10, 24))
