"""Preflight's GPU kernel probe on real devices. Skipped where no CUDA device is present (CI has none; the path
without a GPU is tests/test_nodecheck.py)."""

import pytest
import torch

from elastic_mnist.ops.nodecheck import kernel_probe

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_healthy_gpu_runs_the_test_kernel():
    assert kernel_probe(torch, timeout_s=120).startswith(f"a test kernel ran on {torch.cuda.device_count()} GPU(s)")
