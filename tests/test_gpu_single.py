"""The GPU check's in-process parts (bench/gpu_single.py) on CPU with gloo: what a GPU machine runs on
CUDA with NCCL, so it cannot rot where there is none. The GPU-only assertions skip without CUDA.

    .venv/bin/python -m pytest -q tests/test_gpu_single.py
"""

import pytest
import torch

from bench import gpu_single
from elastic_mnist.state import format as checkpoint


def test_resume_abort_and_memory_checks_on_cpu(small_mnist, tmp_path):
    result = gpu_single.run(tmp_path, small_mnist, torch.device("cpu"), "gloo")
    abort = result["resume_and_abort"]
    assert abort["resumed_at"] == gpu_single.AGREED and abort["rng_restored"]
    # the step done after the last agreement is not what the failure save took: the copy of the agreed one
    assert abort["saved_step"] == gpu_single.AGREED + 2 and abort["live_step"] == gpu_single.AGREED + 3
    assert abort["exit_code"] == 75 and abort["main_thread"] == "returned" and abort["ok"]
    saved = checkpoint.load_latest(str(tmp_path / "abort" / "ckpt"))[0]
    # every registered object from the copy of the agreed step, not only the weights
    assert saved["step"] == saved["scheduler"]["last_epoch"] == gpu_single.AGREED + 2
    assert saved["optimizer"]["state"][0]["step"].item() == gpu_single.AGREED + 2
    memory = result["memory"]
    assert memory["copy"]["copy_bytes"] > 0 and memory["live"]["copy_bytes"] == 0 and memory["ok"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_resume_abort_and_memory_checks_on_the_gpu(small_mnist, tmp_path):
    result = gpu_single.run(tmp_path, small_mnist, torch.device("cuda", 0), "nccl")
    assert result["resume_and_abort"]["ok"] and result["resume_and_abort"]["cuda_rng_saved"]
    assert result["memory"]["copy"]["peak_bytes"] > result["memory"]["live"]["peak_bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_rng_state_holds_every_cuda_devices_generator():
    from elastic_mnist.state.registry import RngState

    torch.cuda.init()
    rng = RngState(seed=3)
    saved = rng.state_dict()
    assert len(saved["cuda"]) == torch.cuda.device_count()
    first = torch.rand(4, device="cuda")
    rng.load_state_dict(saved)
    assert torch.equal(torch.rand(4, device="cuda"), first), "the CUDA generator drew the same again"
