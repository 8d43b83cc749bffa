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
import torch.nn.functional as F
from gloo_group import run_group
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from elastic_mnist.state.reshard import Change, buddy_of, holders, reshard, ring_copy
from elastic_mnist.worker import sharded
from elastic_mnist.worker.model import build_model
from elastic_mnist.worker.optim import Adam

HIDDEN = 13  # rows that split unevenly over 3 and over 2 ranks


def _wrapped(mesh, seed: int):
    model = sharded.shard_blocks(build_model(HIDDEN, seed), mesh, sharded.precision_policy("fp32"))
    return model, Adam(model.parameters(), lr=1e-2)


def _empty(mesh):
    """The model wrapped for `mesh`, never built whole: its rows are uninitialized until load_rows."""
    return sharded.empty_sharded(lambda: build_model(HIDDEN, 0), mesh, sharded.precision_policy("fp32"),
                                 torch.device("cpu"))


def _step(model, optimizer, step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 784, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    F.nll_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _gathered(model, optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor()
        for key, value in optimizer.state[p].items():
            out[f"{name}.{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return out


def _member(rank: int, world: int, out_dir: str) -> None:
    model, optimizer = _wrapped(sharded.mesh_of(), seed=0)
    for step in range(2):
        _step(model, optimizer, step, rank)
    rows, replicated = sharded.rows_of(model, optimizer)
    specs = sharded.specs_of(model, replicated, ["exp_avg", "exp_avg_sq"])
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
    live_opt = Adam(live.parameters(), lr=1e-2)
    sharded.load_rows(live, live_opt, new_rows, replicated)
    loaded, loaded_opt = _wrapped(mesh, seed=1)  # other weights: only the load can make them equal
    msd, osd = get_state_dict(loaded, loaded_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out_dir, "dcp"), process_group=group)
    set_state_dict(loaded, loaded_opt, model_state_dict=msd, optim_state_dict=osd)
    a, b = _gathered(live, live_opt), _gathered(loaded, loaded_opt)
    assert sorted(a) == sorted(b) and len(a) == 4 * 4  # 4 parameters: each, its step, exp_avg and exp_avg_sq
    for name in a:
        assert torch.equal(a[name], b[name]), name
    whole = sum(t.numel() * t.element_size() for t in a.values() if t.dim())
    assert sent < whole / 2, (sent, whole)  # rows that change hands only, never the whole state
    _step(live, live_opt, 2, new_rank)
    _step(loaded, loaded_opt, 2, new_rank)
    a, b = _gathered(live, live_opt), _gathered(loaded, loaded_opt)
    assert all(torch.equal(a[name], b[name]) for name in a)
    with open(os.path.join(out_dir, f"ok-{new_rank}"), "w") as f:
        f.write(str(sent))


def _joined(rank: int, world: int, out_dir: str) -> None:
    """Ranks 0 and 1 train at world 2; rank 2 joins with nothing: it receives only its own rows."""
    pair = dist.new_group([0, 1])
    state = torch.zeros(3, dtype=torch.float64)  # the Adam step of each parameter, as a survivor's agreement sends
    if rank < 2:
        model, optimizer = _wrapped(sharded.mesh_of(pair), seed=0)
        for step in range(2):
            _step(model, optimizer, step, rank)
        rows, replicated = sharded.rows_of(model, optimizer)
        before = _gathered(model, optimizer)
        state[0] = float(next(iter(replicated.values())))
    dist.broadcast(state, src=0)
    names = [n for n, _ in build_model(HIDDEN, 0).named_parameters()]
    replicated = {f"{n}.step": torch.tensor(state[0].item()) for n in names}
    live = _empty(sharded.mesh_of())
    specs = sharded.specs_of(live, replicated, ["exp_avg", "exp_avg_sq"])
    held = {name: {rank: rows[name]} for name in rows} if rank < 2 else {}
    new_rows, sent = reshard(held, specs, Change(2, 3, rank, holders(2, {0: 0, 1: 1})), torch.device("cpu"))
    live_opt = Adam(live.parameters(), lr=1e-2)
    sharded.load_rows(live, live_opt, new_rows, replicated)
    after = _gathered(live, live_opt)
    received = sum(t.numel() * t.element_size() for t in new_rows.values())
    whole = sum(t.numel() * t.element_size() for t in after.values() if t.dim())
    if rank == 2:
        assert received < whole / 2  # a joiner receives its own rows, about a third, nothing more
    torch.save(after, os.path.join(out_dir, f"after-{rank}.pt"))
    if rank < 2:
        torch.save(before, os.path.join(out_dir, f"before-{rank}.pt"))


@pytest.mark.slow  # 3-8 s each (real processes, FSDP): the slow tier keeps the fast one under three minutes on 2 cores
def test_a_joiner_receives_only_its_rows_and_the_state_is_unchanged(tmp_path):
    run_group(_joined, 3, str(tmp_path))
    before = torch.load(tmp_path / "before-0.pt")
    for rank in range(3):
        after = torch.load(tmp_path / f"after-{rank}.pt")
        assert sorted(after) == sorted(before)
        assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.slow  # 3-8 s each (real processes, FSDP): the slow tier keeps the fast one under three minutes on 2 cores
def test_a_reshard_after_a_kill_equals_a_dcp_save_loaded_at_the_new_size(tmp_path):
    run_group(_member, 3, str(tmp_path))
    sent = [int((tmp_path / f"ok-{r}").read_text()) for r in range(2)]
    assert sum(sent) > 0  # rank 1's rows reached rank 0 from rank 2's copy
