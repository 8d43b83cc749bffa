"""What is trained: the runtime's only view of a model and its data. The MNIST MLP is one task; your own
model is another (see examples/cnn_mnist.py and docs/your-model.md).

    torchrun ... examples/cnn_mnist.py --data-dir ../shared/data      # another task, same runtime

A task builds the model (seeded: every rank and every fresh start gets the same weights), the
optimizer, the training and test data sets (map-style, items `(input, target)`), and defines the loss
(summed over a batch) and what counts as correct. Its name and `fingerprint()` go into every
checkpoint, so a checkpoint of another task or shape is refused at resume.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elastic_mnist.config import TrainConfig


class Task:
    """Subclass and override what differs; the defaults are the MNIST classification recipe."""

    name = "task"

    def build_model(self, config: TrainConfig) -> nn.Module:
        raise NotImplementedError

    def build_optimizer(self, model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
        """torch.optim.Adam's update and state format, without the second-long import of torch.compile's
        machinery that torch.optim's base class costs every (re)starting worker (see elastic_mnist/worker/optim.py)."""
        from elastic_mnist.worker.optim import Adam

        return Adam(model.parameters(), lr=config.lr)  # type: ignore[return-value]  # duck-typed Optimizer

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
    """The seed's MLP: 784-HIDDEN-ReLU-10 with log-softmax, trained with NLL and Adam."""

    name = "mnist-mlp"

    def build_model(self, config: TrainConfig) -> nn.Module:
        from elastic_mnist.worker.model import build_model

        return build_model(config.hidden, config.seed)
