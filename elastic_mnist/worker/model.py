"""The seed's MLP: 784-512-ReLU-10 with log-softmax (trained with NLL), flattening its input so it takes
in-memory rows [N, 784] and torchvision's images [N, 1, 28, 28] alike; deeper with --hidden-layers.

    python -c "from elastic_mnist.worker.model import build_model; print(build_model(512))"
"""

from __future__ import annotations

import torch
from torch import nn


def build_model(hidden: int = 512, seed: int = 0, layers: int = 1) -> nn.Module:
    """Same weights on every rank and every fresh start: initialization is seeded, not global-RNG luck.
    One hidden layer keeps the seed's module names (1.weight, 3.weight), so its checkpoints load."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        deeper = [m for _ in range(layers - 1) for m in (nn.Linear(hidden, hidden), nn.ReLU())]
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(28 * 28, hidden),
            nn.ReLU(),
            *deeper,
            nn.Linear(hidden, 10),
            nn.LogSoftmax(dim=1),
        )
