"""What is trained: the runtime's only view of a model and its data. The MNIST MLP is one task; your own
model is another (see examples/cnn_mnist.py and docs/your-model.md).

    torchrun ... examples/cnn_mnist.py --data-dir ../shared/data      # another task, same runtime

A task builds the model (seeded: every rank and every fresh start gets the same weights), the
optimizer and its LR scheduler, any extra state of its own (an EMA of the weights, a counter: anything
with state_dict()/load_state_dict(), checkpointed beside the runtime's), the training and test data
sets (map-style, items `(input, target)`), and defines the loss (summed over a batch) and what counts
as correct. Its name and `fingerprint()` go into every checkpoint, so a checkpoint of another task or
shape is refused at resume.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from elastic_mnist.config import TrainConfig
from elastic_mnist.state.registry import Stateful

# The names the runtime registers itself; Task.extra_state picks others.
RUNTIME_STATE = ("model", "optimizer", "scheduler", "scaler", "rng", "progress")


class Task:
    """Subclass and override what differs; the defaults are the MNIST classification recipe."""

    name = "task"

    def build_model(self, config: TrainConfig) -> nn.Module:
        raise NotImplementedError

    def build_optimizer(self, model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
        """torch.optim.Adam's update and state format, without the second-long import of torch.compile's
        machinery that torch.optim's base class costs every (re)starting worker (see elastic_mnist/worker/optim.py)."""
        from elastic_mnist.worker.optim import Adam

        return Adam(model.parameters(), lr=config.lr)

    def build_scheduler(self, optimizer: torch.optim.Optimizer, config: TrainConfig,
                        steps_per_epoch: int) -> torch.optim.lr_scheduler.LRScheduler | None:
        """Any torch LR scheduler, stepped once after every optimizer step and checkpointed; None: none.
        The default is --lr-schedule as a LambdaLR of the step (see `lr_factor`)."""
        horizon, hold = config.epochs * steps_per_epoch, {"cosine": 0.0, "hold-cosine": 0.5}.get(config.lr_schedule)
        # A plain function, so LambdaLR saves nothing of it: the horizon is today's --epochs, and
        # stopping early with --max-steps and going on later stays on the same schedule.
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, horizon, hold))

    def extra_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                    config: TrainConfig) -> dict[str, Stateful]:
        """Objects of the task's own to checkpoint and restore with the rest, by name (not one of
        RUNTIME_STATE). Built once per (re)start, before the state is restored into them."""
        return {}

    def after_step(self, step: int) -> None:
        """Called after each optimizer step (`step` steps now done), with model, optimizer and step
        consistent: update extra state here (an EMA of the weights)."""

    def shard(self, model: nn.Module, mesh, policy) -> nn.Module:
        """Sharded training only: wrap `model` with torch's `fully_shard` (FSDP2) over `mesh`, computing at
        `policy` (a MixedPrecisionPolicy from --precision). The default makes each direct child that holds
        parameters a unit of its own (a sequential model's blocks), then the root; override to pick other units.
        The model may be on the meta device, with no values yet: wrap it, do not initialize it."""
        from elastic_mnist.worker.sharded import shard_blocks

        return shard_blocks(model, mesh, policy)

    def datasets(self, config: TrainConfig) -> tuple:
        """(train, test): in-memory `data.Split`s (fast path) or any map-style data sets (DataLoader path)."""
        from elastic_mnist.data import mnist as data

        if config.input == "dataloader":
            from elastic_mnist.data.loader import mnist_datasets

            return mnist_datasets(config.data_dir, config.download)
        return data.load_split(config.data_dir, True, config.download), data.load_split(config.data_dir, False)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Summed over the batch: the runtime scales it so uneven shares still average correctly."""
        return F.nll_loss(output, target, reduction="sum")

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output.argmax(1) == target).sum()

    def fingerprint(self, config: TrainConfig) -> dict:
        """What a checkpoint of this task must agree on (besides the config's fingerprint fields)."""
        return {"task": self.name}


class MnistMLP(Task):
    """The seed's MLP: 784-HIDDEN-ReLU-10 with log-softmax (more hidden layers with --hidden-layers), trained
    with NLL and Adam."""

    name = "mnist-mlp"

    def build_model(self, config: TrainConfig) -> nn.Module:
        from elastic_mnist.worker.model import build_model

        return build_model(config.hidden, config.seed, config.hidden_layers)


def lr_factor(step: int, horizon: int, hold: float | None) -> float:
    """--lr-schedule's multiplier of --lr at `step`: 1 throughout (constant, hold None), or a cosine decay
    to 0 at `horizon` that starts after `hold` of it (cosine: 0, hold-cosine: 0.5)."""
    if hold is None:
        return 1.0
    frac = max(0.0, min(step, horizon) / horizon - hold) / (1 - hold)
    return 0.5 * (1 + math.cos(math.pi * frac))
