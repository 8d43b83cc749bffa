"""--precision, --grad-clip, --grad-accum, the scheduler and the registry in one process (world size 1):
a run stopped and resumed ends bit-for-bit where an uninterrupted one does, scaler and scheduler included.
World size 2 and a resize: tests/test_resume_matrix.py (real torchrun).

    .venv/bin/python -m pytest -q tests/test_precision.py
"""

from __future__ import annotations

import math

import pytest
import torch
from trainers import GivenData, in_process_trainer

from elastic_mnist.config import TrainConfig
from elastic_mnist.contract.errors import UserError
from elastic_mnist.data.mnist import Split
from elastic_mnist.state import format as checkpoint
from elastic_mnist.worker.optim import Adam  # torch.optim.SGD would import torch._dynamo: seconds
from elastic_mnist.worker.parallel import DataParallel
from elastic_mnist.worker.step import ScalerState, StepMath
from elastic_mnist.worker.task import MnistMLP

FLAGS = {  # each resumed at world size 1 below and at world size 2 and across a resize in test_resume_matrix
    "bf16+clip+accum": {"precision": "bf16", "grad_clip": 0.5, "grad_accum": 3},
    "fp16+scaler+clip+accum": {"precision": "fp16", "grad_clip": 0.5, "grad_accum": 2},
    "fp32+clip+accum": {"precision": "fp32", "grad_clip": 0.2, "grad_accum": 4, "lr_schedule": "cosine"},
}


def _data(n: int, seed: int = 0) -> Split:
    gen = torch.Generator().manual_seed(seed)
    return Split(torch.randn(n, 784, generator=gen), torch.randint(0, 10, (n,), generator=gen))


def _run(tmp_path, name: str, max_steps: int, **flags):
    config = TrainConfig(**{**{"global_batch_size": 30, "max_steps": max_steps, "epochs": 2, "checkpoint_every": 0,
                                   "hidden": 32, "log_dir": str(tmp_path / name / "runs"), "log_every": 1000,
                                   "checkpoint_dir": str(tmp_path / name / "ckpt")}, **flags})
    trainer = in_process_trainer(config, _data(300), _data(30, 1))
    trainer.train()
    trainer.checkpoints.close()
    return trainer, checkpoint.load_latest(str(tmp_path / name / "ckpt"))[0]


def assert_same_state(a: dict, b: dict, keys=("model", "optimizer", "scheduler", "scaler", "rng")) -> None:
    """Every registered object's state equal to the last bit (tensors with torch.equal)."""
    def same(x, y, where):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and torch.equal(x, y), where
        elif isinstance(x, dict):
            assert x.keys() == y.keys(), where
            for k in x:
                same(x[k], y[k], f"{where}.{k}")
        elif isinstance(x, (list, tuple)):
            assert len(x) == len(y), where
            for i, (u, v) in enumerate(zip(x, y)):
                same(u, v, f"{where}[{i}]")
        else:
            assert x == y, f"{where}: {x!r} != {y!r}"
    for key in keys:
        same(a[key], b[key], key)


@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
def test_resumed_equals_uninterrupted_bit_for_bit(tmp_path, flags):
    _, straight = _run(tmp_path, "a", 14, **flags)
    _run(tmp_path, "b", 6, **flags)
    resumed_trainer, resumed = _run(tmp_path, "b", 14, **flags)
    assert resumed_trainer.progress.resumes == 1 and resumed["step"] == straight["step"] == 14
    assert_same_state(straight, resumed)
    assert resumed["scheduler"]["last_epoch"] == 14
    if flags["precision"] == "fp16":
        assert resumed["scaler"]["_growth_tracker"] == 14, "the GradScaler's state went on across the restart"
    else:
        assert resumed["scaler"] == {}


def test_the_default_schedule_is_a_lambda_lr_of_the_step(tmp_path):
    trainer, state = _run(tmp_path, "s", 5, lr_schedule="hold-cosine", epochs=1)
    assert isinstance(trainer.math.scheduler, torch.optim.lr_scheduler.LambdaLR)
    # 10 steps per epoch, one epoch: half held at --lr, then a cosine decay; step 5 is the decay's start.
    assert trainer.optimizer.param_groups[0]["lr"] == 1e-3 * 0.5 * (1 + math.cos(0.0))
    _, cosine = _run(tmp_path, "c", 5, lr_schedule="cosine", epochs=1)
    assert cosine["optimizer"]["param_groups"][0]["lr"] == 1e-3 * 0.5 * (1 + math.cos(math.pi * 0.5))
    assert state["objects"] == ["model", "optimizer", "progress", "rng", "scaler", "scheduler"]


def _grads(model, x, y, accum: int, batch: int) -> list[torch.Tensor]:
    """The gradient of a share of `len(x)` samples of a global step of `batch` (one rank: no averaging)."""
    config = TrainConfig(global_batch_size=batch, grad_accum=accum)
    math_ = StepMath(config, MnistMLP(), DataParallel(model, 1), Adam(model.parameters(), lr=0.1), None,
                     ScalerState("fp32", "cpu"))
    math_.forward_backward(x, y)
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("share, accum", [(7, 3), (2, 4), (9, 1)])
def test_accumulation_splits_a_share_with_the_exact_weighting(share, accum):
    """An uneven share (7 over 3 micro-batches: 3/2/2), one smaller than --grad-accum (2 over 4): the
    accumulated gradient is the one-pass gradient (float rounding apart)."""
    from elastic_mnist.worker.model import build_model

    x, y = _data(share).images, _data(share).labels
    one = _grads(build_model(32, 0), x, y, accum=1, batch=20)
    split = _grads(build_model(32, 0), x, y, accum=accum, batch=20)
    for a, b in zip(one, split):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_grad_clip_bounds_the_global_norm():
    from elastic_mnist.worker.model import build_model

    model = build_model(32, 0)
    config = TrainConfig(global_batch_size=16, grad_clip=0.01)
    math_ = StepMath(config, MnistMLP(), DataParallel(model, 1), Adam(model.parameters(), lr=0.0), None,
                     ScalerState("fp32", "cpu"))
    math_.forward_backward(_data(16).images, _data(16).labels)
    math_.apply()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    assert norm.item() == pytest.approx(0.01, rel=1e-4)


class _Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


class _Counting(GivenData):
    """A task with extra state of its own, updated after every optimizer step."""

    def extra_state(self, model, optimizer, config):
        self.counter = _Counter()
        return {"counter": self.counter}

    def after_step(self, step):
        self.counter.n += 10


def test_a_tasks_own_state_is_saved_restored_and_refused_by_a_task_without_it(tmp_path):
    from contextlib import ExitStack

    from elastic_mnist.distributed import DistEnv
    from elastic_mnist.worker.build import build_trainer
    from elastic_mnist.worker.control import ControlPlane

    config = TrainConfig(global_batch_size=30, max_steps=4, hidden=32, checkpoint_every=0, log_every=1000,
                         log_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"))

    def build(task, **changes):
        cfg = TrainConfig(**{**config.to_dict(), **changes})
        with ExitStack() as stack:
            trainer = build_trainer(cfg, DistEnv(), task, ControlPlane(1, cfg), stack)
            trainer.train()
            return trainer

    first = _Counting(_data(300), _data(30, 1))
    build(first)
    assert checkpoint.load_latest(str(tmp_path / "ckpt"))[0]["counter"] == {"n": 40}
    again = _Counting(_data(300), _data(30, 1))
    build(again, max_steps=6)
    assert again.counter.n == 60, "restored at 40, then two more steps"
    with pytest.raises(UserError, match=r"holds state for counter that this run does not register.*--checkpoint-dir"):
        build(GivenData(_data(300), _data(30, 1)), max_steps=8)

    class Clash(GivenData):
        def extra_state(self, model, optimizer, config):
            return {"scheduler": _Counter()}

    with pytest.raises(UserError, match="uses the name.*scheduler.*pick other names"):
        build(Clash(_data(300), _data(30, 1)), checkpoint_dir=str(tmp_path / "other"))


def test_an_optimizer_that_is_not_a_torch_optimizer_is_refused_in_one_line(tmp_path):
    from contextlib import ExitStack

    from elastic_mnist.distributed import DistEnv
    from elastic_mnist.worker.build import build_trainer
    from elastic_mnist.worker.control import ControlPlane

    class Duck(GivenData):
        def build_optimizer(self, model, config):
            return object()

    config = TrainConfig(hidden=32, global_batch_size=16, log_dir=str(tmp_path / "runs"),
                         checkpoint_dir=str(tmp_path / "ckpt"))
    with ExitStack() as stack, pytest.raises(UserError, match=r"^Duck.build_optimizer returned a object, not a "
                                                              "torch.optim.Optimizer"):
        build_trainer(config, DistEnv(), Duck(_data(60), _data(10, 1)), ControlPlane(1, config), stack)
    # (nothing was written: the optimizer is checked before the checkpoint dir is claimed)
    assert not (tmp_path / "ckpt").exists()
