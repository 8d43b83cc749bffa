"""The sharded state's agreement with real gloo processes: three ranks train the MLP under fully_shard (FSDP2) with
Adam and keep their rows with a ring copy; then rank 1 is lost and rank 3 joins in the same change. The new
round agrees on the state in memory: rank 1's rows come from rank 2's copy, the joiner receives only its own
rows and the replicated rest (the optimizer's step, the progress) as verified bytes, and every parameter and
optimizer tensor, gathered, is bit-identical to what the old round held. With two ring neighbours lost at once
nothing in memory is whole, and every rank learns the state must come from storage. The new round trains on
and a rank is lost after a step, before its ring copy: the two left agree on the step before, whole."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_group import run_group
from sharded_parts import HIDDEN, LR, gathered, step, wrapped

from elastic_mnist.config import TrainConfig
from elastic_mnist.state import format as checkpoint
from elastic_mnist.state.sharded_sync import Keeper, agree_sharded
from elastic_mnist.worker import sharded
from elastic_mnist.worker.build import sharded_learner
from elastic_mnist.worker.task import MnistMLP

KEY = checkpoint.checkpoint_key(b"a job secret")  # the replicated rest travels keyed, as a checkpoint does
CONFIG = TrainConfig(hidden=HIDDEN, lr=LR)  # the learner's task builds the MLP wrapped() builds


def _old_round(rank: int, group, out_dir: str) -> Keeper:
    """Ranks 0-2 train two steps at world 3, keeping their share after each."""
    model, optimizer = wrapped(sharded.mesh_of(group), CONFIG.seed)
    keeper = None
    for i in range(2):
        step(model, optimizer, i, rank)
        keeper = _advance(keeper, "round-a", rank, 3, group, model, optimizer, i + 1)
    if rank == 0:
        torch.save(gathered(model, optimizer), os.path.join(out_dir, "before-a.pt"))
    else:
        gathered(model, optimizer)
    return keeper


def _advance(keeper, lineage, rank, world, group, model, optimizer, done: int) -> Keeper:
    rows, replicated = sharded.rows_of(model, optimizer)
    if keeper is None:
        keeper = Keeper(lineage, rank, world, sharded.specs_of(model, replicated, ["exp_avg", "exp_avg_sq"]), group)
    keeper.advance(done, rows, {"optimizer": replicated, "progress": {"step": done}})
    return keeper


def _joined(held: list, new_rank: int, world: int, group, name: str, out_dir: str):
    """The new round's learner, as the worker builds it (the task's model wrapped by Task.shard, never whole
    here), holding the state the round agreed on in memory."""
    moved = agree_sharded(held, new_rank, world, torch.device("cpu"), KEY, group)
    assert moved is not None and moved.owner == 0
    assert moved.replicated["progress"] == {"step": moved.step}
    learner = sharded_learner(MnistMLP(), CONFIG, sharded.mesh_of(group), torch.device("cpu"), steps_per_epoch=10)
    sharded.load_rows(learner.model, learner.optimizer, moved.rows, moved.replicated["optimizer"])
    received = sum(t.numel() * t.element_size() for t in moved.rows.values())
    torch.save({"after": gathered(learner.model, learner.optimizer), "received": received, "sent": moved.sent,
                "step": moved.step}, os.path.join(out_dir, f"{name}-{new_rank}.pt"))
    return learner


def _round_b(learner, rank: int, new_rank: int, group, out_dir: str) -> None:
    """Old ranks 0, 2 and the joiner train step 3 and keep it; step 4 is trained, and the joiner dies before
    its ring copy. Whether the others' loss shows in step 4's collectives or in its ring copy, step 3 is the
    newest step whole in memory."""
    step(learner.model, learner.optimizer, 2, new_rank)
    keeper = _advance(None, "round-b", new_rank, 3, group, learner.model, learner.optimizer, 3)
    whole = gathered(learner.model, learner.optimizer)
    if new_rank == 0:
        torch.save(whole, os.path.join(out_dir, "before-b.pt"))
    try:
        step(learner.model, learner.optimizer, 3, new_rank)
        if rank == 3:
            os._exit(0)  # lost after step 4, before its ring copy
        _advance(keeper, "round-b", new_rank, 3, group, learner.model, learner.optimizer, 4)
    except RuntimeError as e:  # the lost peer, in step 4's collectives or in its ring copy
        where = "ring copy" if keeper.steps[0].offer.step == 4 else "step"
        Path(out_dir, f"lost-{rank}").write_text(f"{where}: {str(e)[:200]}")
    return keeper


def _change(rank: int, world: int, out_dir: str) -> None:
    g012, g023, g03, g02 = (dist.new_group(r) for r in ([0, 1, 2], [0, 2, 3], [0, 3], [0, 2]))
    keeper = _old_round(rank, g012, out_dir) if rank < 3 else None
    held = keeper.steps if keeper is not None else []
    if rank == 1:  # lost
        return
    new_rank = {0: 0, 2: 1, 3: 2}[rank]
    learner = _joined(held, new_rank, 3, g023, "after-a", out_dir)  # rank 1 lost and rank 3 joined at once
    if rank != 2:  # old ranks 1 and 2 both gone: old rank 1's rows are nowhere
        assert agree_sharded(held, {0: 0, 3: 1}[rank], 2, torch.device("cpu"), KEY, g03) is None
        Path(out_dir, f"storage-{rank}").write_text("none")
    keeper = _round_b(learner, rank, new_rank, g023, out_dir)
    _joined(keeper.steps, {0: 0, 2: 1}[rank], 2, g02, "after-b", out_dir)


@pytest.mark.slow  # ~13 s (four real processes, FSDP): the slow tier keeps the fast one under three minutes on 2 cores
def test_kills_and_a_join_agree_on_the_newest_state_whole_in_memory(tmp_path):
    run_group(_change, 4, str(tmp_path))
    before = torch.load(tmp_path / "before-a.pt")
    whole = sum(t.numel() * t.element_size() for t in before.values() if t.dim())
    for rank in range(3):
        got = torch.load(tmp_path / f"after-a-{rank}.pt")
        assert got["step"] == 2 and sorted(got["after"]) == sorted(before) and len(before) == 4 * 4
        assert all(torch.equal(got["after"][k], before[k]) for k in before), rank
        assert got["received"] < whole / 2  # its own rows, about a third: never the whole state
    assert torch.load(tmp_path / "after-a-2.pt")["sent"] == 0  # the joiner held nothing to send
    assert (tmp_path / "storage-0").exists() and (tmp_path / "storage-3").exists()
    before = torch.load(tmp_path / "before-b.pt")
    assert (tmp_path / "lost-0").exists() and (tmp_path / "lost-2").exists()
    for rank in range(2):
        got = torch.load(tmp_path / f"after-b-{rank}.pt")
        assert got["step"] == 3 and all(torch.equal(got["after"][k], before[k]) for k in before), rank
