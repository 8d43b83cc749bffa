"""A sharded step is the replicated step: two real gloo processes take the same global batches through the
runtime's step math (worker/step.py) with the MLP and Adam, once replicated (parallel.DataParallel) and once
under fully_shard (sharded.ShardedParallel), with gradient accumulation and clipping; the losses and the
gathered weights agree to float tolerance. The replicated run's state, as a DDP checkpoint holds it, loads
into a model wrapped for the mesh bit for bit: each rank takes only its rows.

    python -m pytest tests/test_sharded_step.py -q
"""

import os
from types import SimpleNamespace

import pytest
import torch
from gloo_group import run_group

from elastic_mnist.worker import sharded
from elastic_mnist.worker.model import build_model
from elastic_mnist.worker.optim import Adam
from elastic_mnist.worker.parallel import DataParallel
from elastic_mnist.worker.step import ScalerState, StepMath
from elastic_mnist.worker.task import MnistMLP

HIDDEN, STEPS, BATCH = 13, 4, 16
CONFIG = SimpleNamespace(grad_accum=2, grad_clip=0.5, global_batch_size=BATCH, precision="fp32")


def _train(replicas, rank: int, world: int) -> tuple[list[float], Adam]:
    optimizer = Adam(replicas.module.parameters(), lr=1e-2)
    math = StepMath(CONFIG, MnistMLP(), replicas, optimizer, None, ScalerState("fp32", "cpu"))
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, 784, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)
        share = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        losses.append(float(math.forward_backward(x[share], y[share])))
        math.apply()
    return losses, optimizer


def _member(rank: int, world: int, out_dir: str) -> None:
    replicated = DataParallel(build_model(HIDDEN, 0), world)
    plain, plain_opt = _train(replicated, rank, world)
    model = sharded.shard_blocks(build_model(HIDDEN, 0), sharded.mesh_of(), sharded.precision_policy("fp32"))
    shard, _ = _train(sharded.ShardedParallel(model, world), rank, world)
    gathered = {name: p.full_tensor() for name, p in model.named_parameters()}
    checkpoint = {"model": replicated.module.state_dict(), "optimizer": plain_opt.state_dict()}
    loaded = sharded.empty_sharded(lambda: build_model(HIDDEN, 0), sharded.mesh_of(), sharded.precision_policy("fp32"),
                                   torch.device("cpu"))
    loaded_opt = Adam(loaded.parameters(), lr=0.5)  # another learning rate: the checkpoint's groups set it
    rows, rest = sharded.from_whole(checkpoint, loaded, loaded_opt, world, rank)
    sharded.load_state({}, loaded, loaded_opt, rows, rest)
    torch.save({"plain": plain, "sharded": shard, "replicated_weights": dict(replicated.module.named_parameters()),
                "sharded_weights": gathered, "checkpoint": checkpoint, "loaded": _whole(loaded, loaded_opt)},
               os.path.join(out_dir, f"rank{rank}.pt"))


def _whole(model, optimizer) -> dict:
    """The sharded model's and optimizer's state gathered, in a replicated run's state dicts' form."""
    state = {i: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in optimizer.state[p].items()}
             for i, p in enumerate(model.parameters())}
    return {"model": {name: p.full_tensor() for name, p in model.named_parameters()},
            "optimizer": {"state": state, "lr": optimizer.param_groups[0]["lr"]}}


@pytest.mark.slow  # 3-8 s each (real processes, FSDP): the slow tier keeps the fast one under three minutes on 2 cores
def test_a_sharded_step_trains_as_the_replicated_step(tmp_path):
    run_group(_member, 2, str(tmp_path))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(got["plain"]) == len(got["sharded"]) == STEPS
        assert torch.allclose(torch.tensor(got["plain"]), torch.tensor(got["sharded"]), rtol=1e-5, atol=1e-6), got
        assert got["plain"][-1] != got["plain"][0]  # it trained
        for name, value in got["replicated_weights"].items():
            assert torch.allclose(value, got["sharded_weights"][name], rtol=1e-5, atol=1e-6), name
        want, loaded = got["checkpoint"], got["loaded"]
        assert all(torch.equal(loaded["model"][k], v) for k, v in want["model"].items())
        assert loaded["optimizer"]["lr"] == want["optimizer"]["param_groups"][0]["lr"] == 1e-2
        for i, per_param in want["optimizer"]["state"].items():
            assert sorted(loaded["optimizer"]["state"][i]) == sorted(per_param) == ["exp_avg", "exp_avg_sq", "step"]
            assert all(torch.equal(loaded["optimizer"]["state"][i][k], v) for k, v in per_param.items()), i
