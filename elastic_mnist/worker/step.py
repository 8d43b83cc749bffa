"""One global step's math: a rank's share of the step split into --grad-accum micro-batches, each under
autocast at --precision (fp16 with a GradScaler), the gradient averaged over ranks once, then --grad-clip,
the optimizer and the LR scheduler.

    python -m elastic_mnist.train --data-dir ../shared/data --precision bf16 --grad-clip 1 --grad-accum 4

The samples of a global step are the BatchPlan's at every world size and every --grad-accum: accumulation
only splits what this rank computes. Each micro-batch's summed loss is scaled by world_size /
global_batch_size, so the sum of the micro-batch gradients averaged over ranks is the mean over the whole
global batch, however unevenly it was split (exact weighting; only float rounding differs).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class ScalerState:
    """torch.amp.GradScaler under --precision fp16 (its scale and growth tracker are checkpointed),
    disabled otherwise (its state is {}). A state of another precision starts the scaler afresh: changing
    --precision between restarts is allowed."""

    def __init__(self, precision: str, device_type: str) -> None:
        self.scaler = torch.amp.GradScaler(device_type, enabled=precision == "fp16")

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state and self.scaler.is_enabled():
            self.scaler.load_state_dict(state)


class StepMath:
    """forward_backward(x, y) leaves the averaged gradient of this rank's share; apply() updates."""

    def __init__(self, config, task, replicas, optimizer: torch.optim.Optimizer, scheduler, scaler: ScalerState):
        self.task, self.replicas, self.optimizer, self.scheduler = task, replicas, optimizer, scheduler
        self.scaler, self.micro, self.clip = scaler.scaler, config.grad_accum, config.grad_clip
        self.weight = replicas.world_size / config.global_batch_size
        dtype, device = PRECISIONS[config.precision], next(replicas.module.parameters()).device
        self.autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype is not None else nullcontext
        self.params = [p for p in replicas.module.parameters() if p.requires_grad]

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's summed loss over its share (detached); the averaged gradient is in .grad."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.micro == 1:
            total = self._micro_step(x, y)
        else:
            # A share smaller than --grad-accum leaves some chunks empty: they add nothing (and are skipped, but
            # where each forward is a collective, as a sharded model's is: every rank runs as many).
            chunks = [(cx, cy) for cx, cy in zip(torch.tensor_split(x, self.micro), torch.tensor_split(y, self.micro))
                      if len(cy) or self.replicas.collective_forward]
            total = sum(self._micro_step(cx, cy, last=i == len(chunks) - 1) for i, (cx, cy) in enumerate(chunks))
        self.replicas.average_gradients()
        return total

    def _micro_step(self, x: torch.Tensor, y: torch.Tensor, last: bool = True) -> torch.Tensor:
        # DDP (a model with buffers) all-reduces in backward: only the last micro-batch may.
        with nullcontext() if last else self.replicas.no_sync():
            with self.autocast():
                loss_sum = self.task.loss(self.replicas(x), y).float()
            self.scaler.scale(loss_sum * self.weight).backward()
        return loss_sum.detach()

    def apply(self) -> None:
        """Clip (fp16: after unscaling), step the optimizer (fp16: unless the gradient overflowed; every
        rank holds the same averaged gradient, so all skip alike), then the scheduler."""
        if self.clip:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.params, self.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
