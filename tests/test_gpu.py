"""The nccl path: one worker per GPU under torchrun. Skipped where no CUDA device is present (CI has none)."""

import json

import pytest
import torch
from conftest import run_torchrun

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_worker_trains_on_the_gpu(small_mnist, tmp_path):
    nproc = min(torch.cuda.device_count(), 2)
    run = run_torchrun(["--standalone", f"--nproc-per-node={nproc}"],
                       ["--data-dir", small_mnist, "--max-steps", "30", "--backend", "nccl",
                        "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "runs")])
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "summary.json").read_text())
    assert summary["global_step"] == 30 and summary["world_size"] == nproc and summary["samples_per_s"] > 0
