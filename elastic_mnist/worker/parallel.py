"""Data parallelism: each rank's gradient of its share of the global batch, averaged over the ranks.

    python -m pytest tests/test_gradient.py -q     # the averaged gradient equals the one-process gradient

A model without buffers needs nothing from torch's DistributedDataParallel but that average, and DDP's
constructor imports torch._dynamo (about a second, at every worker start: on the recovery path of every
membership change). For such a model (the MNIST MLP) the average is one all-reduce of the flattened
gradients after backward. A model with buffers (BatchNorm's running statistics) is wrapped in DDP,
which also keeps its buffers in step across ranks.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from elastic_mnist.distributed import wait


class DataParallel:
    """Forward through `module`; call `average_gradients()` after backward (a no-op where DDP did it)."""

    collective_forward = False
    """Whether every rank must run each forward (a sharded model's gathers its parameters)."""

    def __init__(self, model: nn.Module, world_size: int) -> None:
        self.world_size = world_size
        self.uses_ddp = world_size > 1 and any(True for _ in model.buffers())
        self.module = nn.parallel.DistributedDataParallel(model) if self.uses_ddp else model
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._used: torch.Tensor | None = None  # the all-ones "every parameter was used" flags, reused
        if world_size > 1 and not self.uses_ddp:
            self._same_start()

    def _same_start(self) -> None:
        # What DDP's constructor does: every rank starts from rank 0's parameters. Into a copy: a collective
        # given up on a lost peer (a round in place) must not write into the model after the round ends.
        flat = torch.cat([p.data.reshape(-1) for p in self._params])
        wait(dist.broadcast(flat, src=0, async_op=True))
        for p, value in zip(self._params, torch.split(flat, [p.numel() for p in self._params])):
            p.data.copy_(value.view_as(p))

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        """Backward without DDP's all-reduce (gradient accumulation's early micro-batches)."""
        return self.module.no_sync() if self.uses_ddp else nullcontext()

    def average_gradients(self) -> None:
        if self.world_size == 1 or self.uses_ddp:
            return
        missing = [p.grad is None for p in self._params]
        grads = [torch.zeros_like(p) if m else p.grad for p, m in zip(self._params, missing)]
        if self._used is None:
            self._used = torch.ones(len(grads), dtype=grads[0].dtype, device=grads[0].device)
        # One flag per parameter rides along: a parameter no rank used keeps grad None (Adam skips it, as it
        # does at world size 1); one that some rank used counts as zeros where it was not.
        used = self._used.new_tensor([0.0 if m else 1.0 for m in missing]) if any(missing) else self._used
        flat = torch.cat([g.reshape(-1) for g in grads] + [used])
        flat.div_(self.world_size)  # divided before the sum, as DDP's default communication hook does
        wait(dist.all_reduce(flat, async_op=True))
        parts = torch.split(flat, [g.numel() for g in grads] + [len(grads)])
        # Only a rank that lacks a gradient has to ask whether anyone used it (a host sync, off the usual path).
        anywhere = parts[-1].tolist() if any(missing) else None
        for i, (p, g, synced) in enumerate(zip(self._params, grads, parts)):
            if not missing[i]:
                g.copy_(synced.view_as(g))
            elif anywhere[i] > 0:
                p.grad = synced.view_as(p).clone()
