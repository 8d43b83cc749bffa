"""After a membership change under sharded training: agree on the newest sharded state the new round holds in
memory, and move it to the new world size (state/reshard.py), each rank receiving only its own rows.

    python -m pytest tests/test_sharded_sync.py -q     # a kill and a join at once, and two neighbours lost

What a rank holds between rounds is a `Keeper`'s last two steps, each a `Kept`: its own rows of every sharded
tensor, the copy of its ring predecessor's rows, and the replicated rest (the optimizer's step, the scheduler,
the RNG, the progress). Two, because a rank lost inside the ring copy of
step S leaves the survivors with rows of S but not every copy of S, while S-1 is whole. The ranks all-gather
what they hold (`reshard.Offer`s); `from_memory` picks the newest state whose every old shard some rank holds.
The lowest rank holding it broadcasts the replicated rest and the tensors' shapes as the checkpoint format's
verified bytes, never pickles, and every other rank reads them (the rest is then what a checkpoint of the
step would hold: a rank's RNG may have drawn apart from the others'); then one all-to-all moves the rows.
None: no such state (two ring neighbours lost at once, or nothing in memory), and it comes from storage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from elastic_mnist.compat import private as compat
from elastic_mnist.state import format as checkpoint
from elastic_mnist.state import reshard as reshard_mod
from elastic_mnist.state.registry import map_tensors
from elastic_mnist.state.reshard import Change, Offer, buddy_of, from_memory, reshard
from elastic_mnist.state.sync import TransferRefused, all_gather_bytes, broadcast_bytes


@dataclass
class Kept:
    """One rank's share of a sharded state agreed at `offer.step` by the round `offer.lineage`."""

    offer: Offer
    rows: dict[str, torch.Tensor]
    """This rank's rows of every sharded tensor, by name (worker/sharded.py's `rows_of`)."""
    copy: dict[str, torch.Tensor]
    """Its ring predecessor's rows of the same step ({} at world 1)."""
    specs: dict[str, torch.Tensor]
    """Every sharded tensor's whole shape and dtype, as meta tensors."""
    replicated: dict = field(default_factory=dict)
    """What every rank of the round holds alike: encoded with the checkpoint format when a peer needs it."""
    flats: tuple = ()
    """The byte buffers `rows` and `copy` are views of (the keeper reuses them for a later step)."""
    layout: tuple = ()
    """(rows', copy's) (name, shape, dtype)s: a later step of the same layout reuses the buffers."""


class Keeper:
    """This rank's shares of its round's last two steps (newest first), refreshed after every optimizer step.
    Each `advance` writes into the older step's tensors: hand `steps` to the agreement before the next one."""

    def __init__(self, lineage: str, rank: int, world: int, group=None) -> None:
        self.lineage, self.rank, self.world, self.group = lineage, rank, world, group
        self.steps: list[Kept] = []

    def advance(self, step: int, rows: dict[str, torch.Tensor], specs: dict[str, torch.Tensor],
                replicated: dict) -> None:
        """Collective over the round: keep a copy of this rank's rows of `step` (in the older step's buffers
        where they fit) and of `replicated`, then send the rows to the ring successor. A peer lost inside that
        raises, leaving `step` held without its copy and the step before it whole. `specs`: `rows`' tensors
        whole (they change when the optimizer's state first appears)."""
        spare = self.steps.pop() if len(self.steps) >= 2 else None
        names = sorted(rows)
        own_layout = [(n, rows[n].shape, rows[n].dtype) for n in names]
        copy_layout = reshard_mod.copy_layout(specs, names, self.world, self.rank) if self.world > 1 else []
        device = rows[names[0]].device
        reuse = spare is not None and spare.layout == (own_layout, copy_layout)
        own_flat, own = reshard_mod.flat_views(own_layout, device, spare.flats[0] if reuse else None)
        with torch.no_grad():  # a copy that recorded autograd history would keep the round's tensors alive
            compat.foreach_copy_([own[n] for n in names], [rows[n] for n in names])
        # Copies: the optimizer's step counts and the like change in place at the next step.
        replicated = map_tensors(replicated, lambda t: t.detach().clone())
        kept = Kept(Offer(self.lineage, step, self.rank, self.world), own, {}, specs, replicated)
        kept.layout = (own_layout, copy_layout)
        self.steps.insert(0, kept)
        if self.world == 1:
            kept.flats = (own_flat, None)
            return
        copy_flat, copy = reshard_mod.flat_views(copy_layout, device, spare.flats[1] if reuse else None)
        kept.flats = (own_flat, copy_flat)
        reshard_mod.ring_send(own_flat, copy_flat, self.world, self.rank, self.group)
        kept.copy, kept.offer = copy, replace(kept.offer, copy_step=step)


@dataclass
class Moved:
    """This rank's share of the agreed state in the new round."""

    step: int
    rows: dict[str, torch.Tensor]
    specs: dict[str, torch.Tensor]
    replicated: dict
    sent: int
    """Bytes of rows this rank sent (the replicated rest aside)."""
    owner: int
    """The new rank that sent the replicated rest (or would have)."""
    lineage: str = ""
    """The round that agreed on the state."""


def agree_sharded(held: list[Kept], rank: int, world: int, device: torch.device, key: bytes | None = None,
                  group=None) -> Moved | None:
    """Collective over the new round (`group`, or the default one; `rank` and `world` in it). `held`: what this
    rank keeps (a Keeper's steps; a joiner: [])."""
    offers = _all_offers(held, group)
    found = from_memory(offers)
    if found is None:
        return None
    state, held_by = found
    same = [r for r, os in enumerate(offers) if any((o.lineage, o.step) == (state.lineage, state.step) for o in os)]
    owner, holds = same[0], rank in same
    mine = next((k for k in held if (k.offer.lineage, k.offer.step) == (state.lineage, state.step)), None)
    # Copies: what the round's objects load must not be what this rank keeps (a task's state may update in place).
    specs, replicated = (mine.specs, map_tensors(mine.replicated, torch.clone)) if holds else ({}, {})
    if world > 1:  # the owner's rest, on every rank: its ranks' RNGs drew apart (dropout on unequal shares)
        specs, replicated = _from_owner(state, specs, replicated, owner, holds, key, group)
    shards = _shards(mine, state.step) if holds else {}
    rows, sent = reshard(shards, specs, Change(state.old_world, world, rank, held_by), device, group)
    return Moved(state.step, rows, specs, replicated, sent, owner, state.lineage)


def _all_offers(held: list[Kept], group) -> list[tuple[Offer, ...]]:
    """Every rank's offers, checked alike on every rank: a state two ranks describe differently (another size,
    one old rank twice) is not this package's, and every rank refuses it."""
    mine = json.dumps([_encode_offer(k.offer) for k in held]).encode()
    offers = [tuple(_decode_offer(o) for o in json.loads(b)) for b in all_gather_bytes(mine, group)]
    seen: dict[tuple, tuple[int, set]] = {}
    for offer in (o for each in offers for o in each):
        old_world, ranks = seen.setdefault((offer.lineage, offer.step), (offer.old_world, set()))
        if offer.old_world != old_world or offer.old_rank in ranks:
            raise TransferRefused(f"two ranks describe step {offer.step} of round {offer.lineage!r} differently: "
                                  "check that every node runs the same elastic-mnist")
        ranks.add(offer.old_rank)
    return offers


def _from_owner(state: Offer, specs: dict, replicated: dict, owner: int, holds: bool, key: bytes | None,
                group) -> tuple[dict, dict]:
    """The owner's shapes and replicated rest, broadcast to the round and read by every other rank: the rest
    is what a checkpoint of the step would hold (its RNG is the owner's), so a state moved in memory resumes as
    one read from storage does. Every rank then learns whether all of them could read it, so none is left
    waiting in the reshard."""
    mine, is_owner = b"", holds and dist.get_rank(group) == owner
    if is_owner:
        mine = checkpoint.encode({"step": state.step, "specs": _spec_rows(specs), "replicated": replicated}, key)
    blob, problem = broadcast_bytes(mine, owner, group), ""
    if not is_owner:
        try:
            sent = checkpoint.decode(blob, f"the sharded state from rank {owner}", key)
            if sent["step"] != state.step:
                raise checkpoint.CheckpointError(f"it is of step {sent['step']}, the round agreed on {state.step}")
            specs, replicated = _specs(sent["specs"]), sent["replicated"]
        except Exception as e:  # noqa: BLE001 - whatever a rank cannot read, every rank must learn of
            problem = f"{type(e).__name__}: {e}"[:500]
    problems = [b.decode() for b in all_gather_bytes(problem.encode(), group) if b]
    if problems:
        raise TransferRefused(f"a rank could not read the sharded state rank {owner} sent ({problems[0]}); every "
                              "rank gives this state up")
    return specs, replicated


def _shards(mine: Kept, step: int) -> dict[str, dict[int, torch.Tensor]]:
    """What `reshard` reads of this rank's share: its own rows, and its copy if that is of the same step."""
    old, world = mine.offer.old_rank, mine.offer.old_world
    out = {name: {old: rows} for name, rows in mine.rows.items()}
    if mine.offer.copy_step == step:
        for name, rows in mine.copy.items():
            out[name][buddy_of(old, world)] = rows
    return out


def _encode_offer(o: Offer) -> list:
    return [o.lineage, o.step, o.old_rank, o.old_world, o.copy_step]


MAX_WORLD = 1 << 16
"""No round is larger: an offer naming a larger one is not this package's."""


def _decode_offer(fields: list) -> Offer:
    """A peer's offer, checked: every rank decodes the same offers, so a bad one raises on every rank alike."""
    lineage, step, old_rank, old_world, copy_step = fields
    offer = Offer(str(lineage), int(step), int(old_rank), int(old_world), int(copy_step))
    joiner = offer == Offer()
    if not joiner and not (0 <= offer.old_rank < offer.old_world <= MAX_WORLD and offer.step >= 0
                           and -1 <= offer.copy_step <= offer.step and offer.lineage):
        raise TransferRefused(f"a peer offered sharded state {fields!r}, which no round of this package holds: "
                              "check that every node runs the same elastic-mnist")
    return offer


def _spec_rows(specs: dict[str, torch.Tensor]) -> dict[str, list]:
    return {name: [list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in specs.items()}


def _specs(rows: dict[str, list]) -> dict[str, torch.Tensor]:
    """Meta tensors from a peer's shapes and dtype names: only torch's dtypes are looked up."""
    out = {}
    for name, (shape, dtype) in rows.items():
        kind = getattr(torch, str(dtype), None)
        if not isinstance(kind, torch.dtype):
            raise checkpoint.CheckpointError(f"the sharded state names an unknown dtype {dtype!r} for {name}")
        out[name] = torch.empty([int(n) for n in shape], dtype=kind, device="meta")
    return out
