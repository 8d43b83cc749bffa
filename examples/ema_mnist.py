"""A task that brings its whole training state: torch.optim.SGD with momentum, its own LR scheduler
(cosine annealing over the run) and an extra stateful object, an exponential moving average (EMA) of the
weights. The runtime checkpoints all three beside the model and restores them on every start, so after a
kill, a resize or a preemption they continue exactly where they were.

    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=etcd-v3 --rdzv-endpoint=HOST:2379 --rdzv-id=ema1 \\
        examples/ema_mnist.py --data-dir ../shared/data --lr 0.05 --checkpoint-dir ckpt-ema --log-dir runs-ema
    elastic-mnist local --nodes 2 --script examples/ema_mnist.py --data-dir ../shared/data --lr 0.05 \\
        --chaos 'kill:n1@step=100'

(torch.optim.SGD imports torch._dynamo on its first use, about a second of every worker start; the
default Adam avoids that. A start is also where the EMA is built, before the restore loads it.)
"""

from __future__ import annotations

from elastic_mnist.warm import handoff

# Under an etcd-v3 agent, run as a fork of its warm process (torch already imported): this must come before
# `import torch` (docs/your-model.md).
handoff(preload=("torch", "elastic_mnist.train"))

import torch  # noqa: E402 - after the hand-off above
from torch import nn  # noqa: E402 - after the hand-off above

from elastic_mnist.task import MnistMLP  # noqa: E402 - after the hand-off above
from elastic_mnist.train import launch  # noqa: E402 - after the hand-off above


class EMA:
    """shadow <- decay * shadow + (1 - decay) * weights after every optimizer step; Stateful."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        self.model, self.decay, self.updates = model, decay, 0
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        for name, value in self.model.state_dict().items():
            if name in self.shadow:
                self.shadow[name].lerp_(value, 1 - self.decay)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.updates = state["decay"], state["updates"]
        for name, value in state["shadow"].items():
            self.shadow[name].copy_(value)


class EmaMnist(MnistMLP):
    """The MNIST MLP (--hidden) with SGD momentum, cosine annealing and an EMA of its weights."""

    name = "mnist-mlp-ema"

    def build_optimizer(self, model: nn.Module, config) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)

    def build_scheduler(self, optimizer, config, steps_per_epoch: int):
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.epochs * steps_per_epoch)

    def extra_state(self, model: nn.Module, optimizer, config) -> dict:
        self.ema = EMA(model)
        return {"ema": self.ema}

    def after_step(self, step: int) -> None:
        self.ema.update()


if __name__ == "__main__":
    launch(EmaMnist())
