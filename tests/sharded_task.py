"""A user's own task under --parallel fsdp, for tests/e2e/test_sharded_chaos.py: dropout in the model (drawn from
the global RNG inside the step), torch.optim.AdamW, a step LR schedule and a counter of its own, run with
--precision bf16 --grad-accum 2.

    elastic-mnist local --nodes 3 --script tests/sharded_task.py --parallel fsdp --precision bf16 --grad-accum 2
"""

from __future__ import annotations

from elastic_mnist.warm import handoff

handoff(preload=("torch", "elastic_mnist.train"))

import torch  # noqa: E402 - after the hand-off above
from torch import nn  # noqa: E402 - after the hand-off above

from elastic_mnist.task import MnistMLP  # noqa: E402 - after the hand-off above
from elastic_mnist.train import launch  # noqa: E402 - after the hand-off above


class Counter:
    """How many optimizer steps this task saw (Stateful)."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


class ShardedTask(MnistMLP):
    name = "mnist-mlp-dropout"

    def build_model(self, config) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            return nn.Sequential(nn.Flatten(), nn.Linear(784, config.hidden), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(config.hidden, 10), nn.LogSoftmax(dim=1))

    def build_optimizer(self, model: nn.Module, config) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01)

    def build_scheduler(self, optimizer, config, steps_per_epoch: int):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.8)

    def extra_state(self, model: nn.Module, optimizer, config) -> dict:
        self.counter = Counter()
        return {"counter": self.counter}

    def after_step(self, step: int) -> None:
        self.counter.count += 1


if __name__ == "__main__":
    launch(ShardedTask())
