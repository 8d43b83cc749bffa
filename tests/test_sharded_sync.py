"""The sharded state's agreement with real gloo processes: three ranks train the MLP under fully_shard (FSDP2) with
Adam and a cosine LR schedule, keeping their rows with a ring copy after every step; then rank 1 is lost and
rank 3 joins in the same change. The new round agrees on the state in memory: rank 1's rows come from rank 2's
copy, the joiner receives only its own rows and the rest (the optimizer's step and learning rate, the
scheduler, the RNG, the progress) as verified bytes, and every parameter and optimizer tensor, gathered, is
bit-identical to what the old round held. With two ring neighbours lost at once nothing in memory is whole,
and every rank learns the state must come from storage. The new round trains on and its rank 0 is lost after a
step, before its ring copy; the two left and a rank that comes back agree on the step before, whole, sent by
the lowest holder, which is not the group's first rank."""

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
from elastic_mnist.worker.build import registry_of, sharded_learner
from elastic_mnist.worker.task import MnistMLP

KEY = checkpoint.checkpoint_key(b"a job secret")  # the rest travels keyed, as a checkpoint does
CONFIG = TrainConfig(hidden=HIDDEN, lr=LR, lr_schedule="cosine", epochs=1)
STEPS_PER_EPOCH = 8  # the cosine's horizon: the learning rate changes at every step


class Round:
    """One round's learner on this rank, with its registered objects and what it keeps after each step."""

    def __init__(self, group, rank: int, world: int, lineage: str, fresh: bool) -> None:
        self.rank, self.world, self.group, self.lineage = rank, world, group, lineage
        self.learner = sharded_learner(MnistMLP(), CONFIG, sharded.mesh_of(group), torch.device("cpu"),
                                       STEPS_PER_EPOCH, fresh=fresh)
        self.objects = registry_of(self.learner, CONFIG)
        self.keeper = None

    def train(self, done: int) -> None:
        """Step `done` (1-based): the optimizer, the scheduler, then the keep."""
        step(self.learner.model, self.learner.optimizer, done - 1, self.rank)
        self.learner.scheduler.step()
        self.keep(done)

    def keep(self, done: int) -> None:
        model, optimizer = self.learner.model, self.learner.optimizer
        rows, rest = sharded.split_state(self.objects, model, optimizer)
        self.keeper = self.keeper or Keeper(self.lineage, self.rank, self.world, self.group)
        self.keeper.advance(done, rows, sharded.specs_of(model, optimizer), {**rest, "progress": {"step": done}})

    def snapshot(self) -> dict:
        """Collective: the whole state, with the learning rate and the scheduler's count."""
        return {**gathered(self.learner.model, self.learner.optimizer),
                "lr": self.learner.optimizer.param_groups[0]["lr"], "last_epoch": self.learner.scheduler.last_epoch}

    def take(self, held: list, name: str, out_dir: str) -> int:
        """Agree on the state in memory and load it; the step it was of."""
        moved = agree_sharded(held, self.rank, self.world, torch.device("cpu"), KEY, self.group)
        assert moved is not None and moved.replicated["progress"] == {"step": moved.step}
        sharded.load_state(self.objects, self.learner.model, self.learner.optimizer, moved.rows, moved.replicated)
        received = sum(t.numel() * t.element_size() for t in moved.rows.values())
        torch.save({"after": self.snapshot(), "received": received, "sent": moved.sent, "step": moved.step,
                    "owner": moved.owner},
                   os.path.join(out_dir, f"{name}-{self.rank}.pt"))
        return moved.step


def _save(out_dir: str, name: str, state: dict, rank: int) -> None:
    if rank == 0:
        torch.save(state, os.path.join(out_dir, name))


def _round_b(rank: int, g023, out_dir: str, kept: list) -> list:
    """Old ranks 0, 2 and the joiner take round a's state, train step 3 and keep it; step 4 is trained, and rank
    0 dies before its ring copy. Whether the others' loss shows in step 4's collectives or in its ring copy,
    step 3 is the newest step whole in memory. What each left keeps."""
    b = Round(g023, {0: 0, 2: 1, 3: 2}[rank], 3, "round-b", fresh=False)
    assert b.take(kept, "after-a", out_dir) == 2
    b.train(3)
    _save(out_dir, "before-b.pt", b.snapshot(), rank)
    try:
        step(b.learner.model, b.learner.optimizer, 3, b.rank)
        b.learner.scheduler.step()
        if rank == 0:
            os._exit(0)  # lost after step 4, before its ring copy
        b.keep(4)
    except RuntimeError:  # the lost peer, in step 4's collectives or in its ring copy
        pass
    return b.keeper.steps


def _change(rank: int, world: int, out_dir: str) -> None:
    g012, g023, g03, g123 = (dist.new_group(r) for r in ([0, 1, 2], [0, 2, 3], [0, 3], [1, 2, 3]))
    kept = []
    if rank < 3:
        a = Round(g012, rank, 3, "round-a", fresh=True)
        a.train(1)
        a.train(2)
        _save(out_dir, "before-a.pt", a.snapshot(), rank)
        kept = a.keeper.steps if rank != 1 else []  # rank 1 is lost, and comes back later as a new process
    if rank in (0, 3):  # old ranks 1 and 2 both gone: old rank 1's rows are nowhere
        assert agree_sharded(kept, {0: 0, 3: 1}[rank], 2, torch.device("cpu"), KEY, g03) is None
        Path(out_dir, f"storage-{rank}").write_text("none")
    if rank != 1:
        kept = _round_b(rank, g023, out_dir, kept)  # rank 1 lost and rank 3 joined at once; rank 0 lost at the end
    # Rank 1 joins ranks 2 and 3 (group ranks 0, 1, 2): the state's lowest holder, group rank 1, sends it the rest.
    assert Round(g123, rank - 1, 3, "round-c", fresh=False).take(kept, "after-b", out_dir) == 3


def _same(got: dict, want: dict) -> bool:
    return sorted(got) == sorted(want) and all(
        torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k] for k in want)


@pytest.mark.slow  # ~10 s (four real processes, FSDP): the slow tier keeps the fast one under three minutes on 2 cores
def test_kills_and_a_join_agree_on_the_newest_state_whole_in_memory(tmp_path):
    run_group(_change, 4, str(tmp_path))
    before = torch.load(tmp_path / "before-a.pt")
    assert before["last_epoch"] == 2 and before["lr"] < LR  # the schedule moved: a fresh optimizer would not match
    whole = sum(t.numel() * t.element_size() for t in before.values() if isinstance(t, torch.Tensor) and t.dim())
    for rank in range(3):
        got = torch.load(tmp_path / f"after-a-{rank}.pt")
        assert got["step"] == 2 and _same(got["after"], before) and len(before) == 4 * 4 + 2, rank
        assert got["received"] < whole / 2  # its own rows, about a third: never the whole state
    assert torch.load(tmp_path / "after-a-2.pt")["sent"] == 0  # the joiner held nothing to send
    assert (tmp_path / "storage-0").exists() and (tmp_path / "storage-3").exists()
    before = torch.load(tmp_path / "before-b.pt")
    for rank in range(3):
        got = torch.load(tmp_path / f"after-b-{rank}.pt")
        assert got["step"] == 3 and _same(got["after"], before) and got["owner"] == 1, rank
        assert got["received"] < whole / 2
    assert torch.load(tmp_path / "after-b-0.pt")["sent"] == 0  # the joiner


def _rounds(rank: int, world: int, out_dir: str) -> None:
    """Three rounds in one process, each a group of its own, a sharded step and a keep: what a kept worker does."""
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    from elastic_mnist.compat import private as compat

    store = dist.FileStore(os.path.join(out_dir, "rounds-store"), 1)
    dist.destroy_process_group()  # run_group's: each round below forms its own, as a kept worker's rounds do
    alive, keepers = [], []
    for i in range(3):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"round{i}", store), rank=0, world_size=1)
        model, optimizer = wrapped(sharded.mesh_of(name=f"round{i}"))
        step(model, optimizer, i, 0)
        keeper = Keeper(f"L{i}", 0, 1)
        rows, rest = sharded.split_state({}, model, optimizer)
        keeper.advance(i, rows, sharded.specs_of(model, optimizer), rest)
        keepers = [keeper]  # what the process holds between rounds: the last round's keeper only
        del model, optimizer, rows, rest
        dist.destroy_process_group()
        compat.forget_meshes()
        gc.collect()
        alive.append(sum(isinstance(o, DeviceMesh) for o in gc.get_objects()))
    assert keepers and alive == [0, 0, 0], f"meshes (and their process groups) alive after each round: {alive}"
    dist.init_process_group("gloo", store=dist.PrefixStore("last", store), rank=0, world_size=1)  # run_group's end


@pytest.mark.slow  # a real process (its own groups)
def test_a_round_leaves_no_mesh_behind_it_with_its_process_group(tmp_path):
    """A keep's copy that recorded autograd history, or DTensor's caches, would keep every round's mesh, and
    through it that round's process group (a thread, a socket, file descriptors), alive."""
    run_group(_rounds, 1, str(tmp_path))
