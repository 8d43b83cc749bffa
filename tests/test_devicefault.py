"""A GPU that fails while training ends its node with the node-local exit, not a crash loop: the CUDA runtime's own
words (as torch raises them) are recognised, the program's own errors are not, and the worker's exit is 69 whether
the device fails in a step or while the process builds.

    python -m pytest -q tests/test_devicefault.py
"""

from __future__ import annotations

import pytest
import torch

from elastic_mnist import agent_link
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.errors import NodeLocalError
from elastic_mnist.worker import life
from elastic_mnist.worker import train as worker_train
from elastic_mnist.worker.devicefault import device_fault

# What torch raises, word for word: the runtime's text after "CUDA error: ", then torch's advice lines.
ADVICE = ("\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
          "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\nCompile with "
          "`TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
ILLEGAL = "CUDA error: an illegal memory access was encountered" + ADVICE
ECC = "CUDA error: uncorrectable ECC error encountered" + ADVICE


@pytest.mark.parametrize("error", [RuntimeError(ILLEGAL), torch.AcceleratorError(ECC),
                                   RuntimeError("CUDA error: unspecified launch failure" + ADVICE),
                                   RuntimeError("CUDA driver error: uncorrectable NVLink error detected during the "
                                                "execution"),
                                   RuntimeError("CUDA error: no CUDA-capable device is detected")])
def test_a_device_error_is_this_nodes_fault(error):
    why = device_fault(error)
    assert why and str(error).splitlines()[0] in why and "this node leaves the job" in why


def test_the_code_torch_attaches_is_enough_and_causes_are_searched():
    coded = torch.AcceleratorError("CUDA error: (text of a newer runtime)")
    coded.error_code = 214
    assert "uncorrectable ECC error" in device_fault(coded)
    try:
        try:
            raise RuntimeError(ILLEGAL)
        except RuntimeError as inner:
            raise ValueError("loss is nan") from inner
    except ValueError as outer:
        assert "illegal memory access" in device_fault(outer)


@pytest.mark.parametrize("message", [
    "CUDA error: device-side assert triggered" + ADVICE,  # an index out of range: the program's bug
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.77 GiB total capacity)",
    "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k)`",
    "mat1 and mat2 shapes cannot be multiplied (64x784 and 128x10)",
    "an illegal memory access was encountered",  # not from CUDA
])
def test_the_programs_own_errors_are_not(message):
    assert device_fault(RuntimeError(message)) is None


class _Trainer:
    world_size = 2

    def __init__(self, error: BaseException):
        self.error, self.asked = error, []

    def train(self):
        raise self.error

    def handle_failure(self, error):
        self.asked.append(error)
        return None


def test_a_step_that_meets_a_device_error_ends_the_node_without_asking_for_a_lost_peer():
    """No wait for the heartbeat's verdict and no save from a broken CUDA context: the node leaves."""
    trainer = _Trainer(RuntimeError(ILLEGAL))
    with pytest.raises(NodeLocalError, match="illegal memory access") as raised:
        life.Life._train(object.__new__(life.Life), trainer)
    assert trainer.asked == [] and isinstance(raised.value.__cause__, RuntimeError)
    other = _Trainer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    with pytest.raises(RuntimeError, match="shapes"):
        life.Life._train(object.__new__(life.Life), other)
    assert len(other.asked) == 1, "anything else goes the usual way"


@pytest.mark.parametrize("error", [NodeLocalError("this node's GPU failed (CUDA error: ...)"), RuntimeError(ECC)])
def test_the_worker_exits_with_the_node_local_code_and_tells_its_agent(error, monkeypatch, tmp_path, capfd):
    """From a step (NodeLocalError, above) or while the process builds (the raw CUDA error): exit 69, and the agent
    is told, so that under etcd-v3 it leaves the rendezvous and exits 69 itself (FailIndex, the node marked)."""
    told = []
    monkeypatch.setattr(agent_link, "report_node_local", lambda line, environ=None: told.append(line) or True)

    def failing_life(*_args):
        raise error

    monkeypatch.setattr(life, "live", failing_life)
    code = worker_train.main(["--data-dir", str(tmp_path), "--checkpoint-dir", str(tmp_path / "c"),
                              "--log-dir", str(tmp_path / "r")])
    assert code == exit_codes.NODE_LOCAL == 69 and len(told) == 1 and "GPU failed" in told[0]
    assert "elastic-mnist train: error: this node's GPU failed" in capfd.readouterr().err


def test_any_other_error_still_crashes_the_worker(monkeypatch, tmp_path):
    monkeypatch.setattr(life, "live", lambda *_a: (_ for _ in ()).throw(RuntimeError("CUDA error: device-side assert")))
    with pytest.raises(RuntimeError, match="device-side assert"):
        worker_train.main(["--data-dir", str(tmp_path), "--checkpoint-dir", str(tmp_path / "c"),
                           "--log-dir", str(tmp_path / "r")])
