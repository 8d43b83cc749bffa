"""The sharded state's agreement with real gloo processes: three ranks train the MLP under fully_shard (FSDP2) with
Adam and keep their rows with a ring copy; then rank 1 is lost and rank 3 joins in the same change. The new
round agrees on the state in memory: rank 1's rows come from rank 2's copy, the joiner receives only its own
rows and the replicated rest (the optimizer's step, the progress) as verified bytes, and every parameter and
optimizer tensor, gathered, is bit-identical to what the old round held. With two ring neighbours lost at once
nothing in memory is whole, and every rank learns the state must come from storage."""

import os

import pytest
import torch
import torch.distributed as dist
from gloo_group import run_group
from sharded_parts import HIDDEN, LR, gathered, step, wrapped

from elastic_mnist.config import TrainConfig
from elastic_mnist.state import format as checkpoint
from elastic_mnist.state.sharded_sync import agree_sharded, keep
from elastic_mnist.worker import sharded
from elastic_mnist.worker.build import sharded_learner
from elastic_mnist.worker.task import MnistMLP

KEY = checkpoint.checkpoint_key(b"a job secret")  # the replicated rest travels keyed, as a checkpoint does
CONFIG = TrainConfig(hidden=HIDDEN, lr=LR)  # the learner's task builds the MLP wrapped() builds


def _old_round(rank: int, group, out_dir: str):
    """Ranks 0-2 train two steps at world 3 and keep their share of step 2."""
    model, optimizer = wrapped(sharded.mesh_of(group), CONFIG.seed)
    for i in range(2):
        step(model, optimizer, i, rank)
    rows, replicated = sharded.rows_of(model, optimizer)
    specs = sharded.specs_of(model, replicated, ["exp_avg", "exp_avg_sq"])
    before = gathered(model, optimizer)
    if rank == 0:
        torch.save(before, os.path.join(out_dir, "before.pt"))
    return keep(rows, specs, {"optimizer": replicated, "progress": {"step": 2}}, "round-a", 2, rank, 3, group)


def _new_round(kept, new_rank: int, group, out_dir: str) -> None:
    """Old ranks 0 and 2 and the joiner (old rank 3) as new ranks 0-2."""
    moved = agree_sharded(kept, new_rank, 3, torch.device("cpu"), KEY, group)
    assert moved is not None and moved.step == 2 and moved.owner == 0
    assert moved.replicated["progress"] == {"step": 2}
    # The round's learner as the worker builds it: the task's model wrapped by Task.shard, never whole here.
    learner = sharded_learner(MnistMLP(), CONFIG, sharded.mesh_of(group), torch.device("cpu"), steps_per_epoch=10)
    sharded.load_rows(learner.model, learner.optimizer, moved.rows, moved.replicated["optimizer"])
    received = sum(t.numel() * t.element_size() for t in moved.rows.values())
    torch.save({"after": gathered(learner.model, learner.optimizer), "received": received, "sent": moved.sent},
               os.path.join(out_dir, f"after-{new_rank}.pt"))


def _change(rank: int, world: int, out_dir: str) -> None:
    old, new, too_few = dist.new_group([0, 1, 2]), dist.new_group([0, 2, 3]), dist.new_group([0, 3])
    kept = _old_round(rank, old, out_dir) if rank < 3 else None
    if rank != 1:  # rank 1 is lost
        _new_round(kept, {0: 0, 2: 1, 3: 2}[rank], new, out_dir)
    if rank in (0, 3):  # old ranks 1 and 2 both gone: old rank 1's rows are nowhere
        assert agree_sharded(kept, {0: 0, 3: 1}[rank], 2, torch.device("cpu"), KEY, too_few) is None
        with open(os.path.join(out_dir, f"storage-{rank}"), "w") as f:
            f.write("none")


@pytest.mark.slow  # ~13 s (four real processes, FSDP): the slow tier keeps the fast one under three minutes on 2 cores
def test_a_kill_and_a_join_at_once_agree_on_the_state_in_memory(tmp_path):
    run_group(_change, 4, str(tmp_path))
    before = torch.load(tmp_path / "before.pt")
    whole = sum(t.numel() * t.element_size() for t in before.values() if t.dim())
    for rank in range(3):
        got = torch.load(tmp_path / f"after-{rank}.pt")
        assert sorted(got["after"]) == sorted(before) and len(before) == 4 * 4  # each parameter, step, moments
        assert all(torch.equal(got["after"][k], before[k]) for k in before), rank
        assert got["received"] < whole / 2  # its own rows, about a third: never the whole state
    joiner = torch.load(tmp_path / "after-2.pt")
    assert joiner["sent"] == 0  # it held nothing to send
    assert (tmp_path / "storage-0").exists() and (tmp_path / "storage-3").exists()
