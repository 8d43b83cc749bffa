"""Preflight's GPU kernel probe: a tiny matmul on every visible GPU, waited for within a bound. On a machine without
a GPU it reports "no GPU"; a device that raises, hangs or computes wrong fails the node (NodeLocal, exit 69), and a
hung one never hangs preflight. (The probe on a real GPU: tests/test_gpu_kernel_probe.py.)

    python -m pytest -q tests/test_nodecheck.py
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

from elastic_mnist.ops import nodecheck
from elastic_mnist.ops.nodecheck import NodeLocal, kernel_probe


@pytest.mark.skipif(torch.cuda.is_available(), reason="the path of a machine without a GPU")
def test_without_a_gpu_the_probe_says_so_and_launches_nothing():
    assert kernel_probe(torch) == "no GPU"


class _Result:
    def __init__(self, value, compute=None):
        self.value, self.compute = value, compute

    def __matmul__(self, other):
        if self.compute:
            self.compute()
        return self

    def sum(self):
        return self

    def item(self):
        return self.value


def fake_torch(devices: int, value: float = 64.0 ** 3, compute=None) -> types.SimpleNamespace:
    """torch as the probe uses it: cuda.is_available/device_count/synchronize, ones(..., device=) and a matmul."""
    synced: list[int] = []
    cuda = types.SimpleNamespace(is_available=lambda: devices > 0, device_count=lambda: devices,
                                 synchronize=synced.append)
    return types.SimpleNamespace(cuda=cuda, synced=synced, ones=lambda *shape, device: _Result(value, compute))


def test_every_gpu_runs_the_kernel_and_is_synchronized():
    fake = fake_torch(2)
    assert kernel_probe(fake).startswith("a test kernel ran on 2 GPU(s)") and fake.synced == [0, 1]
    assert kernel_probe(fake_torch(0)) == "no GPU"


def test_a_device_error_fails_the_node_naming_the_gpu_and_the_error():
    def ecc():
        raise torch.AcceleratorError("CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors might ...")

    with pytest.raises(NodeLocal, match=r"GPU 0 failed a 64x64 test matmul \(CUDA error: uncorrectable ECC error "
                                        r"encountered\)"):
        kernel_probe(fake_torch(1, compute=ecc))


def test_a_wrong_result_fails_the_node():
    with pytest.raises(NodeLocal, match="GPU 0 computed a 64x64 test matmul wrong"):
        kernel_probe(fake_torch(1, value=12.0))


def test_a_hung_device_fails_the_node_within_the_bound_and_is_left_behind():
    release = threading.Event()
    try:
        with pytest.raises(NodeLocal, match="GPU 0: a 64x64 test matmul did not finish within 0s"):
            kernel_probe(fake_torch(1, compute=lambda: release.wait(30)), timeout_s=0.05)
        assert nodecheck.kernel_hung(), "preflight then ends without waiting for the thread (os._exit)"
    finally:
        release.set()
        for thread in nodecheck._hung:
            thread.join(5)
    assert not nodecheck.kernel_hung()
