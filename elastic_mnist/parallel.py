"""Data parallelism: each rank's gradient of its share of the global batch, averaged over the ranks.

    python -m pytest tests/test_gradient.py -q     # the averaged gradient equals the one-process gradient

A model without buffers needs nothing from torch's DistributedDataParallel but that average, and DDP's
constructor imports torch._dynamo (about a second, at every worker start: on the recovery path of every
membership change). For such a model (the MNIST MLP) the average is one all-reduce of the flattened
gradients after backward. A model with buffers (BatchNorm's running statistics) is wrapped in DDP,
which also keeps its buffers in step across ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class DataParallel:
    """Forward through `module`; call `average_gradients()` after backward (a no-op where DDP did it)."""

    def __init__(self, model: nn.Module, world_size: int) -> None:
        self.world_size = world_size
        self.uses_ddp = world_size > 1 and any(True for _ in model.buffers())
        self.module = nn.parallel.DistributedDataParallel(model) if self.uses_ddp else model
        self._params = [p for p in model.parameters() if p.requires_grad]
        if world_size > 1 and not self.uses_ddp:
            self._same_start()

    def _same_start(self) -> None:
        # What DDP's constructor does: every rank starts from rank 0's parameters.
        for p in self._params:
            dist.broadcast(p.data, src=0)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def average_gradients(self) -> None:
        if self.world_size == 1 or self.uses_ddp:
            return
        for p in self._params:
            if p.grad is None:  # unused in this forward: it still takes part, as zeros (as in DDP)
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self._params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(self.world_size)  # divide first, as DDP does: the same sum, the same rounding
        dist.all_reduce(flat)
        for g, synced in zip(grads, torch.split(flat, [g.numel() for g in grads])):
            g.copy_(synced.view_as(g))
