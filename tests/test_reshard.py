"""Live resharding: the plan covers every new row exactly once from a rank that holds it, and real gloo
processes that reshard after a kill (3 -> 2, the lost rank's rows from its ring neighbour's copy) and on a
join (2 -> 3, the joiner holding nothing) end with exactly the rows of the whole tensors."""

import os

import pytest
import torch
import torch.distributed as dist
from gloo_group import run_group
from sharded_parts import ring_copy

from elastic_mnist.state.reshard import (
    Change,
    LostShard,
    Offer,
    buddy_of,
    from_memory,
    holders,
    plan,
    reshard,
    shard_rows,
)

SHAPES = {"w1": ((10, 3), torch.float32), "w2": ((7, 2), torch.float32), "b": ((2,), torch.float32),
          "v": ((5,), torch.float64), "n": ((9, 2), torch.int64)}


def _whole() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {name: (torch.randint(0, 1000, shape, generator=gen) if dtype == torch.int64
                   else torch.randn(shape, generator=gen, dtype=dtype)) for name, (shape, dtype) in SHAPES.items()}


def _held(whole: dict, world: int, old_rank: int) -> dict[str, dict[int, torch.Tensor]]:
    """What old rank `old_rank` keeps: its own rows and its ring predecessor's copy."""
    out = {}
    for name, t in whole.items():
        own = {r: t[slice(*shard_rows(t.shape[0], world, r))].clone() for r in {old_rank, buddy_of(old_rank, world)}}
        out[name] = own
    return out


@pytest.mark.parametrize("n,old,lost,joined", [(10, 3, {1}, 0), (10, 2, set(), 1), (2, 3, {2}, 0), (7, 4, set(), 2),
                                               (1, 2, {0}, 0), (13, 8, {1, 4, 6}, 0), (13, 8, {7}, 3)])
def test_the_plan_covers_each_new_shard_once_from_a_holder(n, old, lost, joined):
    stayed = {r: i for i, r in enumerate(r for r in range(old) if r not in lost)}
    new = len(stayed) + joined
    held_by = holders(old, stayed)
    pieces = plan(n, old, new, held_by)
    for dst in range(new):
        a, b = shard_rows(n, new, dst)
        mine = sorted((p.start, p.stop) for p in pieces if p.dst == dst)
        covered = [i for s, e in mine for i in range(s, e)]
        assert covered == list(range(a, b))
    for p in pieces:  # every piece comes from the rank that holds that old shard, and lies inside it
        oa, ob = shard_rows(n, old, p.old)
        assert p.src == held_by[p.old] and oa <= p.start < p.stop <= ob


def test_a_lost_rank_is_served_by_its_ring_neighbour_and_two_lost_neighbours_lose_a_shard():
    assert holders(3, {0: 0, 2: 1}) == {0: 0, 1: 1, 2: 1}  # old 1's copy is on old 2, now rank 1
    assert holders(4, {0: 0, 3: 1}) == {0: 0, 2: 1, 3: 1}  # old 1 and its neighbour old 2 are both gone
    with pytest.raises(LostShard, match="old rank 1 of 4"):
        plan(8, 4, 2, holders(4, {0: 0, 3: 1}))


def test_the_newest_state_whose_every_shard_is_held_is_chosen_or_none():
    a = [Offer("L", 7, 0, 3, 7), Offer("L", 7, 2, 3, 7), Offer()]  # old 1 lost (copy on old 2); a joiner
    chosen, held_by = from_memory(a)
    assert (chosen.lineage, chosen.step, chosen.old_world) == ("L", 7, 3) and held_by == {0: 0, 1: 1, 2: 1}
    stale = [Offer("L", 7, 0, 3, 7), Offer("L", 7, 2, 3, 6)]  # old 2's copy is of step 6: old 1's rows are gone
    assert from_memory(stale) is None
    older = [Offer("M", 9, 0, 2, 9), Offer("L", 7, 0, 1, 7)]  # M lost old 1 whose copy old 0 holds; L is whole
    chosen, held_by = from_memory(older)
    assert (chosen.lineage, chosen.step) == ("M", 9) and held_by == {0: 0, 1: 0}
    assert from_memory([Offer(), Offer()]) is None  # a fresh start: storage
    assert from_memory([Offer("M", 9, 0, 3, 9), Offer("L", 7, 0, 1, 7)])[0].lineage == "L"  # M misses old 1


def _after_kill(rank: int, world: int, out_dir: str) -> None:
    whole = _whole()
    held = _held(whole, world, rank)
    group = dist.new_group([0, 2])  # old rank 1 is killed: old 0 and 2 are the new round's ranks 0 and 1
    if rank == 1:
        return
    new_rank = {0: 0, 2: 1}[rank]
    change = Change(3, 2, new_rank, holders(3, {0: 0, 2: 1}))
    specs = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in SHAPES.items()}
    shards, sent = reshard(held, specs, change, torch.device("cpu"), group)
    torch.save({"shards": shards, "sent": sent}, os.path.join(out_dir, f"kill-{new_rank}.pt"))


def _after_join(rank: int, world: int, out_dir: str) -> None:
    whole = _whole()
    held = _held(whole, 2, rank) if rank < 2 else {}  # rank 2 joins with nothing
    change = Change(2, 3, rank, holders(2, {0: 0, 1: 1}))
    specs = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in SHAPES.items()}
    shards, sent = reshard(held, specs, change, torch.device("cpu"))
    torch.save({"shards": shards, "sent": sent}, os.path.join(out_dir, f"join-{rank}.pt"))


@pytest.mark.slow  # 3-8 s each (real processes, FSDP): the slow tier keeps the fast one under three minutes on 2 cores
@pytest.mark.parametrize("kind,fn,new_world", [("kill", _after_kill, 2), ("join", _after_join, 3)])
def test_real_processes_reshard_to_exactly_the_whole_tensors_rows(tmp_path, kind, fn, new_world):
    run_group(fn, 3, str(tmp_path))
    whole = _whole()
    total = sum(t.numel() * t.element_size() for t in whole.values())
    for rank in range(new_world):
        got = torch.load(tmp_path / f"{kind}-{rank}.pt")
        for name, t in whole.items():
            assert torch.equal(got["shards"][name], t[slice(*shard_rows(t.shape[0], new_world, rank))]), name
        assert got["sent"] <= total // 2  # a rank sends only rows that change hands, never the whole


def _ring(rank: int, world: int, out_dir: str) -> None:
    whole = _whole()
    specs = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in SHAPES.items()}
    mine = {name: t[slice(*shard_rows(t.shape[0], world, rank))] for name, t in whole.items()}
    got = ring_copy(mine, specs, world, rank)
    for name, t in whole.items():
        assert torch.equal(got[name], t[slice(*shard_rows(t.shape[0], world, buddy_of(rank, world)))]), name
    open(os.path.join(out_dir, f"ring-{rank}"), "w").close()


@pytest.mark.slow  # 3-8 s each (real processes, FSDP): the slow tier keeps the fast one under three minutes on 2 cores
@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_receives_its_ring_predecessors_rows(tmp_path, world):
    run_group(_ring, world, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [f"ring-{r}" for r in range(world)]


def test_a_ring_copy_cut_short_leaves_the_step_before_it_whole():
    """Old rank 2 of 3 died inside step 8's ring copy: old 0 and 1 hold their rows of 8 without a copy of it, and
    both rows and copies of step 7; old 2's rows are whole only at 7 (in old 0's copy)."""
    cut = [(Offer("L", 8, 0, 3, -1), Offer("L", 7, 0, 3, 7)), (Offer("L", 8, 1, 3, -1), Offer("L", 7, 1, 3, 7))]
    chosen, held_by = from_memory(cut)
    assert chosen.step == 7 and held_by == {0: 0, 1: 1, 2: 0}
    done = [(Offer("L", 8, 0, 3, 8), Offer("L", 7, 0, 3, 7)), (Offer("L", 8, 1, 3, -1), Offer("L", 7, 1, 3, 7))]
    assert from_memory(done)[0].step == 8  # old 0 received old 2's rows of 8 before it died: 8 is whole
