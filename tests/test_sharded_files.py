"""Sharded checkpoints: three real gloo processes save a fully_shard model and its Adam state through DCP;
two of them load it at world 2 and one process loads it whole, equal to what was saved, into a model that is
not sharded too (a replicated run resumes from it); a step is published
once, a damaged shard is refused before DCP reads it, and keep-k's removal takes the shards with it."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_torchrun
from gloo_group import run_group
from sharded_parts import HIDDEN, LR, gathered, step, wrapped
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from elastic_mnist.state import format as checkpoint
from elastic_mnist.state import sharded_files
from elastic_mnist.worker import sharded
from elastic_mnist.worker.model import build_model
from elastic_mnist.worker.optim import Adam

KEY = checkpoint.checkpoint_key(b"a job secret")


def _member(rank: int, world: int, directory: str) -> None:
    model, optimizer = wrapped(sharded.mesh_of())
    for i in range(2):
        step(model, optimizer, i, rank)
    before = gathered(model, optimizer)
    msd, osd = get_state_dict(model, optimizer)
    _, rest = sharded.split_state({}, model, optimizer)  # what every rank holds alike: the checkpoint file's part
    assert sharded_files.save(directory, 2, {"model": msd, "optim": osd}, {"note": "rest", **rest}, KEY)
    assert not sharded_files.save(directory, 2, {"model": msd, "optim": osd}, {"note": "late"}, KEY)
    if rank == 0:
        torch.save(before, os.path.join(directory, "before.pt"))
    group = dist.new_group([0, 2])
    if rank == 1:
        return
    state = checkpoint.decode(Path(checkpoint.path_for(directory, 2)).read_bytes(), key=KEY)
    loaded, loaded_opt = wrapped(sharded.mesh_of(group), seed=1)
    msd, osd = get_state_dict(loaded, loaded_opt)
    sharded_files.load(directory, state, {"model": msd, "optim": osd}, group)
    set_state_dict(loaded, loaded_opt, model_state_dict=msd, optim_state_dict=osd)
    after = gathered(loaded, loaded_opt)
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.slow  # 3-8 s each (real processes, FSDP): the slow tier keeps the fast one under three minutes on 2 cores
def test_saved_at_three_loaded_at_two_and_whole_and_refused_when_damaged(tmp_path):
    directory = str(tmp_path / "ckpt")
    run_group(_member, 3, directory)
    before = torch.load(os.path.join(directory, "before.pt"))
    state = checkpoint.decode(Path(checkpoint.path_for(directory, 2)).read_bytes(), key=KEY)
    assert state["note"] == "rest"  # the first save's; the late one left it as it was
    whole = sharded_files.load_whole(directory, state)
    assert {k for k in before if before[k].dim()} <= set(whole)
    assert all(torch.equal(whole[k], before[k]) for k in before if before[k].dim())
    replicated = sharded_files.to_whole(whole, state)  # a run that does not shard resumes from it
    model = build_model(HIDDEN, seed=1)
    optimizer = Adam(model.parameters(), lr=0.5)
    model.load_state_dict(replicated["model"])
    optimizer.load_state_dict(replicated["optimizer"])
    assert optimizer.param_groups[0]["lr"] == LR
    for name, p in model.named_parameters():
        assert torch.equal(p, before[f"model.{name}"])
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, before[f"optim.state.{name}.{key}"]), (name, key)
    shard = next(p for p in sorted(os.listdir(sharded_files.shards_dir(directory, 2))) if p.endswith(".distcp"))
    path = os.path.join(sharded_files.shards_dir(directory, 2), shard)
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="checksum mismatch"):
        sharded_files.load_whole(directory, state)
    sharded_files.remove(directory, 2)
    assert not os.path.exists(sharded_files.shards_dir(directory, 2))
    assert not [n for n in os.listdir(directory) if ".tmp-" in n]  # no temp dir left behind


@pytest.mark.slow  # two torchrun runs of two sharded workers
def test_a_checkpoint_whose_shards_do_not_verify_is_set_aside_and_the_run_resumes_from_the_one_before(
        small_mnist, tmp_path):
    common = ["--data-dir", small_mnist, "--checkpoint-dir", str(tmp_path / "ckpt"),
              "--log-dir", str(tmp_path / "runs"), "--parallel", "fsdp", "--checkpoint-every", "10",
              "--global-batch-size", "64"]
    first = run_torchrun(["--standalone", "--nproc-per-node=2"], [*common, "--max-steps", "20"])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    shards = sharded_files.shards_dir(str(tmp_path / "ckpt"), 20)
    damaged = os.path.join(shards, next(n for n in sorted(os.listdir(shards)) if n.endswith(".distcp")))
    data = bytearray(Path(damaged).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(damaged).write_bytes(bytes(data))
    second = run_torchrun(["--standalone", "--nproc-per-node=2"], [*common, "--max-steps", "25"])
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    out = second.stdout + second.stderr
    assert "[resume] step 10 from" in out and "checksum mismatch" in out and "moved aside" in out
    assert sorted(os.listdir(tmp_path / "ckpt" / "corrupt")) == ["ckpt-000000020.pt", "ckpt-000000020.shards"], \
        "the damaged step, file and shards, kept to look at"
    assert checkpoint.list_checkpoints(str(tmp_path / "ckpt"))[0][0] == 25
