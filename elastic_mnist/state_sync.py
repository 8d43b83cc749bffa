"""After every rendezvous: agree which rank holds the newest valid state, and send it to those that lack it.

    torchrun ... -m elastic_mnist.train --checkpoint-storage local --checkpoint-dir /local/ckpt

Each rank offers its best candidate: the newest verified checkpoint in its --checkpoint-dir, or a newer
in-memory snapshot (--snapshot-dir, e.g. /dev/shm, which outlives the worker process). The ranks
all-gather (step, checksum); the lowest rank holding the newest step broadcasts its bytes to every rank
that does not hold the same; receivers verify the checksum. With shared storage every rank sees the
same newest file and nothing is sent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from elastic_mnist import checkpoint
from elastic_mnist.errors import UserError


@dataclass
class Candidate:
    step: int
    blob: bytes
    source: str
    """The file it came from, for the resume line."""

    @property
    def digest(self) -> str:
        return checkpoint.digest_of(self.blob)


def newest_valid(directory: str, warn: Callable[[str], None], origin: dict | None = None) -> Candidate | None:
    """The newest file in `directory` that verifies (and, for snapshots, belongs to this job)."""
    for step, path, blob, state in checkpoint.iter_valid(directory, warn):
        if origin is not None and state.get("origin") != origin:
            warn(f"warning: ignoring snapshot {path}: it belongs to another job ({state.get('origin')})")
            continue
        return Candidate(step, blob, path)
    return None


def best_local(checkpoint_dir: str, snapshot_dir: str, origin: dict, warn) -> Candidate | None:
    found = [c for c in (newest_valid(checkpoint_dir, warn), newest_valid(snapshot_dir, warn, origin) if
                         snapshot_dir else None) if c is not None]
    return max(found, key=lambda c: c.step, default=None)


def agree_errors(error: str | None, world_size: int) -> None:
    """Every rank raises the same UserError if any rank found bad input; nobody is left in a collective."""
    errors = [error]
    if world_size > 1:
        errors = [None] * world_size
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise UserError(first)


def agree_on_state(mine: Candidate | None, rank: int, world_size: int) -> tuple[Candidate | None, int, list[int]]:
    """(the newest state, the rank that had it, the ranks it was sent to)."""
    offers = [(mine.step, mine.digest) if mine else (-1, "")]
    if world_size > 1:  # a lone process has nobody to agree with (and may have no process group)
        offers = [None] * world_size
        dist.all_gather_object(offers, (mine.step, mine.digest) if mine else (-1, ""))
    best = max(step for step, _ in offers)
    if best < 0:
        return None, -1, []
    owner = min(r for r, (step, _) in enumerate(offers) if step == best)
    needy = [r for r, offer in enumerate(offers) if offer != offers[owner]]
    if not needy:
        return mine, owner, []
    box = [mine.blob if rank == owner else None]
    dist.broadcast_object_list(box, src=owner)
    if rank in needy:
        mine = Candidate(best, box[0], f"rank {owner} (sent over the process group)")
    return mine, owner, needy


def keep_durable_copy(candidate: Candidate, directory: str) -> bool:
    """A state that came from a peer or from memory also goes to this rank's checkpoint dir."""
    path = checkpoint.path_for(directory, candidate.step)
    if os.path.abspath(candidate.source) == os.path.abspath(path):
        return False
    return checkpoint.write_durable(path, candidate.blob)
