"""Your own model on the elastic runtime: a small CNN on MNIST, with the same flags, checkpoints,
resume, batch order and fault tolerance as the built-in MLP.

    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=etcd-v3 --rdzv-endpoint=HOST:2379 --rdzv-id=cnn1 \\
        examples/cnn_mnist.py --data-dir ../shared/data --checkpoint-dir ckpt-cnn --log-dir runs-cnn
    python examples/cnn_mnist.py --data-dir ../shared/data --epochs 1     # one process

What a task defines (elastic_mnist.task.Task): the model, and optionally the optimizer, the data sets,
the loss (summed over a batch) and what counts as correct. Everything else is the runtime's.
"""

from __future__ import annotations

from elastic_mnist.warm import handoff

# Under an etcd-v3 agent, run as a fork of its warm process (torch already imported): this must come before
# `import torch` (docs/your-model.md).
handoff(preload=("torch", "elastic_mnist.train"))

import torch  # noqa: E402 - after the hand-off above
from torch import nn  # noqa: E402 - after the hand-off above

from elastic_mnist.task import Task  # noqa: E402 - after the hand-off above
from elastic_mnist.train import launch  # noqa: E402 - after the hand-off above


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),          # 28 -> 14
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 14 -> 7
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * channels * 7 * 7, 10), nn.LogSoftmax(dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The in-memory data path gives rows of 784 pixels, the DataLoader path [1, 28, 28] images.
        return self.head(self.features(x.reshape(-1, 1, 28, 28)))


class CnnMnist(Task):
    name = "mnist-cnn"

    def build_model(self, config) -> nn.Module:
        # Seeded here, not by global RNG luck: every rank and every fresh start gets the same weights.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            return SmallCNN()

    def fingerprint(self, config) -> dict:
        return {"task": self.name, "channels": 16}  # a checkpoint of another shape is refused at resume


if __name__ == "__main__":
    launch(CnnMnist())
