"""Live resharding in memory: tensors split by rows across the ranks (FSDP2's dim-0 shards) move from one
world size to another over the process group, each rank sending and receiving only the rows that change hands.

    python -m pytest tests/test_reshard.py -q       # 3 -> 2 after a kill, 2 -> 3 on a join, against the whole

A tensor of `n` rows is split as torch.chunk splits it, which is how `fully_shard` splits a parameter: ceil(n /
world) rows a rank, the last ranks short or empty. Besides its own rows, every rank keeps a copy of its ring
neighbour's (rank r holds r-1's: `buddy_of`), refreshed whenever the shards change, so one lost rank's rows
are still in memory; two neighbours lost at once lose a shard (`LostShard`: the state comes from storage).
Every rank derives the same plan from the same facts (the row count, both world sizes, who holds which old
shard), so what travels needs no header: one all-to-all of bytes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic_mnist.distributed import wait


class LostShard(RuntimeError):
    """No rank of the new round holds an old shard (its owner and its ring neighbour are both gone)."""


def shard_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the `n` rows that `rank` of `world` holds: torch.chunk's split, as fully_shard's."""
    per = -(-n // world)
    start = min(rank * per, n)
    return start, min(start + per, n)


def buddy_of(rank: int, world: int) -> int:
    """The old rank whose shard `rank` keeps a copy of (its ring predecessor)."""
    return (rank - 1) % world


def holders(old_world: int, new_rank_of: dict[int, int], copies: set[int] | None = None) -> dict[int, int]:
    """Old rank -> the new rank that holds its shard: its owner if it stayed, else the owner's ring successor
    (who keeps the copy). `new_rank_of` maps each old rank that stayed to its rank in the new round; `copies`,
    when given, the new ranks whose copy is of the same step (a copy of another step serves nobody)."""
    out = {}
    for old in range(old_world):
        successor = new_rank_of.get((old + 1) % old_world) if old_world > 1 else None
        if old in new_rank_of:
            out[old] = new_rank_of[old]
        elif successor is not None and (copies is None or successor in copies):
            out[old] = successor
    return out


@dataclass(frozen=True)
class Offer:
    """What one rank of the new round holds of an earlier round's shards (a joiner: nothing, lineage "")."""

    lineage: str = ""
    """The round that agreed on the state: every survivor of that round holds rows of the same step."""
    step: int = -1
    old_rank: int = -1
    old_world: int = 0
    copy_step: int = -1
    """The step of its copy of its ring predecessor's rows (-1: none)."""


def from_memory(offers: list[Offer | tuple[Offer, ...]]) -> tuple[Offer, dict[int, int]] | None:
    """The newest state whose every old shard some rank of the new round holds (`offers[r]` is new rank r's
    offer, or its offers when it holds several steps): (the state, as an offer of it, and which new rank holds
    each old shard), or None (it comes from storage)."""
    each = [o if isinstance(o, tuple) else (o,) for o in offers]
    states = {(o.step, o.lineage, o.old_world) for held in each for o in held if o.lineage and o.step >= 0}
    for step, lineage, old_world in sorted(states, reverse=True):
        mine = {r: o for r, held in enumerate(each) for o in held if (o.lineage, o.step) == (lineage, step)}
        held_by = holders(old_world, {o.old_rank: r for r, o in mine.items()},
                          {r for r, o in mine.items() if o.copy_step == step})
        if len(held_by) == old_world:
            return Offer(lineage, step, -1, old_world), held_by
    return None


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of old rank `old`'s shard, sent by new rank `src` to new rank `dst`."""

    src: int
    dst: int
    old: int
    start: int
    stop: int


def plan(n: int, old_world: int, new_world: int, held_by: dict[int, int]) -> list[Piece]:
    """Every piece the new shards of an `n`-row tensor are made of, in (dst, start) order."""
    pieces = []
    for dst in range(new_world):
        a, b = shard_rows(n, new_world, dst)
        for old in range(old_world):
            oa, ob = shard_rows(n, old_world, old)
            lo, hi = max(a, oa), min(b, ob)
            if lo >= hi:
                continue
            if old not in held_by:
                raise LostShard(f"rows {oa}..{ob} of old rank {old} of {old_world}: neither it nor its ring "
                                f"neighbour {(old + 1) % old_world} is in the new round")
            pieces.append(Piece(held_by[old], dst, old, lo, hi))
    return pieces


@dataclass(frozen=True)
class Change:
    """A membership change as this rank of the new round sees it."""

    old_world: int
    new_world: int
    rank: int
    """This rank in the new round."""
    held_by: dict
    """Old rank -> the new rank holding its shard (`holders`)."""


def reshard(shards: dict[str, dict[int, torch.Tensor]], specs: dict[str, torch.Tensor], change: Change,
            device: torch.device, group=None) -> tuple[dict[str, torch.Tensor], int]:
    """This rank's new shard of every tensor (on `device`), and the bytes it sent. Collective over the new
    round's group (`group`, or the default one).

    `shards[name]` maps each old rank whose shard this rank holds (its own, its buddy copy) to those rows; a
    joiner holds none. `specs[name]` is a tensor of the whole tensor's shape and dtype (a meta tensor: only
    those are read); every rank passes the same names."""
    out, sends, recvs, local = {}, defaultdict(list), defaultdict(list), []
    old_world, rank = change.old_world, change.rank
    for name in sorted(specs):
        spec, n = specs[name], specs[name].shape[0]
        a, b = shard_rows(n, change.new_world, rank)
        out[name] = torch.empty((b - a, *spec.shape[1:]), dtype=spec.dtype, device=device)
        for p in plan(n, old_world, change.new_world, change.held_by):
            if p.src == rank:
                oa = shard_rows(n, old_world, p.old)[0]
                rows = shards[name][p.old][p.start - oa:p.stop - oa]
                if p.dst == rank:
                    local.append((rows, out[name][p.start - a:p.stop - a]))
                else:
                    sends[p.dst].append(rows)
            elif p.dst == rank:
                recvs[p.src].append(out[name][p.start - a:p.stop - a])
    for source, target in local:
        target.copy_(source)
    return out, _exchange(sends, recvs, change.new_world, device, group)


def copy_layout(specs: dict[str, torch.Tensor], names: list[str], world: int, rank: int) -> list[tuple]:
    """(name, shape, dtype) of the ring predecessor's rows of each tensor: what `ring_send` receives."""
    out = []
    for name in names:
        a, b = shard_rows(specs[name].shape[0], world, buddy_of(rank, world))
        out.append((name, (b - a, *specs[name].shape[1:]), specs[name].dtype))
    return out


_ALIGN = 64  # bytes: every view of a flat buffer starts where any dtype may


def flat_views(layout: list[tuple], device: torch.device, flat: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One byte buffer for tensors of `layout` ((name, shape, dtype) each), and a view of it for each: rows kept
    and sent as one message, with no copy to gather them. `flat`: an earlier buffer of the same layout, reused."""
    offsets, total = [], 0
    for _, shape, dtype in layout:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += _numel(shape) * dtype.itemsize
    if flat is None or flat.numel() != total:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    views = {name: flat[o:o + _numel(shape) * dtype.itemsize].view(dtype).view(shape)
             for (name, shape, dtype), o in zip(layout, offsets)}
    return flat, views


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def ring_send(own: torch.Tensor, into: torch.Tensor, world: int, rank: int, group=None) -> None:
    """Collective: this rank's flat buffer to its ring successor, its predecessor's into `into`, as one
    all-to-all (gloo's point-to-point work cannot be waited on as `wait` waits on a lost peer)."""
    out_sizes, in_sizes = [0] * world, [0] * world
    out_sizes[(rank + 1) % world] += own.numel()
    in_sizes[buddy_of(rank, world)] += into.numel()
    wait(dist.all_to_all_single(into, own, in_sizes, out_sizes, group=group, async_op=True))


def _exchange(sends: dict, recvs: dict, world: int, device: torch.device, group) -> int:
    """One all-to-all of bytes: each peer's rows in plan order, of every dtype (gloo's point-to-point work has
    no future, so it could not be waited on as `wait` waits: a lost peer would hold the reshard)."""
    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)

    out_parts = [[as_bytes(t) for t in sends.get(peer, [])] for peer in range(world)]
    in_sizes = [sum(t.numel() * t.element_size() for t in recvs.get(peer, [])) for peer in range(world)]
    out_sizes = [sum(b.numel() for b in parts) for parts in out_parts]
    parts = [b for peer_parts in out_parts for b in peer_parts]
    flat_out = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    flat_in = torch.empty(sum(in_sizes), dtype=torch.uint8, device=device)
    wait(dist.all_to_all_single(flat_in, flat_out, in_sizes, out_sizes, group=group, async_op=True))
    targets = [t for peer in range(world) for t in recvs.get(peer, [])]
    for t, chunk in zip(targets, torch.split(flat_in, [t.numel() * t.element_size() for t in targets])):
        as_bytes(t).copy_(chunk)  # a row slice of a new shard: contiguous, so its bytes view writes into it
    return sum(out_sizes)
