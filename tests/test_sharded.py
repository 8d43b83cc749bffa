"""A reshard in memory is exact: three real gloo processes train the MLP under fully_shard (FSDP2) with Adam,
keep their rows and a copy of their ring neighbour's; rank 1 is then lost. The two left reshard in memory
(rank 1's rows from its neighbour's copy), wrap a fresh model for the new mesh and load their rows: every
parameter and optimizer state tensor, gathered, is bit-identical to a DCP save at world 3 loaded at world 2,
and the next step of both is identical too."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gloo_group import run_group
from sharded_parts import HIDDEN, LR, gathered, ring_copy, step, wrapped
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from elastic_mnist.state.reshard import Change, buddy_of, holders, reshard
from elastic_mnist.worker import sharded
from elastic_mnist.worker.model import build_model
from elastic_mnist.worker.optim import Adam


def _empty(mesh):
    """The model wrapped for `mesh`, never built whole: its rows are uninitialized until load_rows."""
    return sharded.empty_sharded(lambda: build_model(HIDDEN, 0), mesh, sharded.precision_policy("fp32"),
                                 torch.device("cpu"))


def _member(rank: int, world: int, out_dir: str) -> None:
    model, optimizer = wrapped(sharded.mesh_of(), seed=0)
    for i in range(2):
        step(model, optimizer, i, rank)
    rows, replicated = sharded.rows_of(model, optimizer)
    specs = sharded.specs_of(model, optimizer)
    buddy = ring_copy(rows, specs, world, rank)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out_dir, "dcp"))
    group = dist.new_group([0, 2])
    if rank == 1:  # lost: its rows live on in rank 2's copy
        return
    new_rank = {0: 0, 2: 1}[rank]
    held = {name: {rank: rows[name], buddy_of(rank, world): buddy[name]} for name in rows}
    change = Change(world, 2, new_rank, holders(world, {0: 0, 2: 1}))
    new_rows, sent = reshard(held, specs, change, torch.device("cpu"), group)
    mesh = sharded.mesh_of(group)
    live = _empty(mesh)
    live_opt = Adam(live.parameters(), lr=LR)
    sharded.load_rows(live, live_opt, new_rows, replicated)
    loaded, loaded_opt = wrapped(mesh, seed=1)  # other weights: only the load can make them equal
    msd, osd = get_state_dict(loaded, loaded_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out_dir, "dcp"), process_group=group)
    set_state_dict(loaded, loaded_opt, model_state_dict=msd, optim_state_dict=osd)
    a, b = gathered(live, live_opt), gathered(loaded, loaded_opt)
    assert sorted(a) == sorted(b) and len(a) == 4 * 4  # 4 parameters: each, its step, exp_avg and exp_avg_sq
    for name in a:
        assert torch.equal(a[name], b[name]), name
    whole = sum(t.numel() * t.element_size() for t in a.values() if t.dim())
    assert sent < whole / 2, (sent, whole)  # rows that change hands only, never the whole state
    step(live, live_opt, 2, new_rank)
    step(loaded, loaded_opt, 2, new_rank)
    a, b = gathered(live, live_opt), gathered(loaded, loaded_opt)
    assert all(torch.equal(a[name], b[name]) for name in a)
    with open(os.path.join(out_dir, f"ok-{new_rank}"), "w") as f:
        f.write(str(sent))


@pytest.mark.slow  # 3-8 s each (real processes, FSDP): the slow tier keeps the fast one under three minutes on 2 cores
def test_a_reshard_after_a_kill_equals_a_dcp_save_loaded_at_the_new_size(tmp_path):
    run_group(_member, 3, str(tmp_path))
    sent = [int((tmp_path / f"ok-{r}").read_text()) for r in range(2)]
    assert sum(sent) > 0  # rank 1's rows reached rank 0 from rank 2's copy
