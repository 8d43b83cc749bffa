"""What the sharded-state tests share: the MLP under fully_shard (FSDP2) with Adam, a training step on seeded
random data, and the whole state gathered by the names a DCP checkpoint flattens it to."""

from __future__ import annotations

import torch

from bench.reshard import train_step
from elastic_mnist.state.reshard import copy_layout, flat_views, ring_send
from elastic_mnist.worker import sharded
from elastic_mnist.worker.model import build_model
from elastic_mnist.worker.optim import Adam

HIDDEN = 13  # rows that split unevenly over 3 ranks and over 2
LR = 1e-2


def wrapped(mesh, seed: int = 0):
    """(the MLP wrapped for `mesh`, its Adam); another `seed`, other weights."""
    model = sharded.shard_blocks(build_model(HIDDEN, seed), mesh, sharded.precision_policy("fp32"))
    return model, Adam(model.parameters(), lr=LR)


def step(model, optimizer, step: int, rank: int) -> None:
    """One optimizer step on this rank's batch of `step` (seeded by both), as the reshard bench takes them."""
    train_step(model, optimizer, step, rank, batch=8)


def gathered(model, optimizer) -> dict[str, torch.Tensor]:
    """Collective: every parameter and optimizer state tensor whole (`model.<param>`, `optim.state.<param>.<key>`)."""
    out = {}
    for name, p in model.named_parameters():
        out[f"model.{name}"] = p.full_tensor()
        for key, value in optimizer.state[p].items():
            out[f"optim.state.{name}.{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return out


def ring_copy(local: dict[str, torch.Tensor], specs: dict[str, torch.Tensor], world: int, rank: int,
              group=None) -> dict[str, torch.Tensor]:
    """Collective: send this rank's rows of every tensor to its ring successor; return its predecessor's (the
    copy `buddy_of` names), as the keeper does after each step (state/sharded_sync.py). `specs` as for
    `reshard`."""
    if world == 1:
        return {}
    names = sorted(local)
    device = local[names[0]].device
    own_flat, own = flat_views([(n, local[n].shape, local[n].dtype) for n in names], device)
    for n in names:
        own[n].copy_(local[n])
    copy_flat, copy = flat_views(copy_layout(specs, names, world, rank), device)
    ring_send(own_flat, copy_flat, world, rank, group)
    return copy
