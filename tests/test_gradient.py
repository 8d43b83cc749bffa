"""Uneven shards: 128 samples over 3 ranks (43/43/42). The DDP-averaged gradient must equal the
single-process gradient of the same global batch."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
from gloo_group import run_group
from trainers import in_process_trainer

from elastic_mnist.config import TrainConfig
from elastic_mnist.data.mnist import Split
from elastic_mnist.distributed import DistEnv


def _split(n: int = 600) -> Split:
    gen = torch.Generator().manual_seed(7)
    return Split(torch.randn(n, 784, generator=gen), torch.randint(0, 10, (n,), generator=gen))


def _grads(rank: int, world: int, step: int, work: str) -> list[torch.Tensor]:
    return _step(rank, world, step, work)[0]


def _step(rank: int, world: int, step: int, work: str) -> tuple[list[torch.Tensor], bool]:
    config = TrainConfig(global_batch_size=128, log_dir="", checkpoint_dir=os.path.join(work, f"ckpt-{world}"))
    trainer = in_process_trainer(config, _split(), _split(50), DistEnv(rank=rank, world_size=world))
    trainer.forward_backward(step)
    return [p.grad.clone() for p in trainer.model.parameters()], trainer.replicas.uses_ddp


def _worker(rank: int, world: int, out_dir: str) -> None:
    grads, uses_ddp = _step(rank, world, 3, out_dir)
    torch.save(grads, os.path.join(out_dir, f"grads{rank}.pt"))
    # The MLP has no buffers: its gradients are averaged without DDP, whose constructor imports
    # torch._dynamo (a second of every worker start).
    assert not uses_ddp and "torch._dynamo" not in sys.modules


@pytest.mark.slow
def test_ddp_gradient_over_three_uneven_ranks_equals_single_process(tmp_path):
    run_group(_worker, 3, str(tmp_path))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        expected = _grads(0, 1, 3, str(tmp_path))
    finally:
        dist.destroy_process_group()
    for rank in range(3):
        got = torch.load(tmp_path / f"grads{rank}.pt", weights_only=True)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def _bn_worker(rank: int, world: int) -> None:
    from elastic_mnist.worker.parallel import DataParallel

    torch.manual_seed(rank)  # different starting weights: both paths must start every rank from rank 0's
    for model in (torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)), torch.nn.Linear(4, 3)):
        replicas = DataParallel(model, world)
        assert replicas.uses_ddp is isinstance(model, torch.nn.Sequential)  # buffers -> DDP
        replicas(torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
        replicas.average_gradients()
        for t in [*model.parameters(), *(p.grad for p in model.parameters())]:
            gathered = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(gathered, t.detach().contiguous())
            assert all(torch.equal(gathered[0], g) for g in gathered), "ranks disagree"
    _branches_used_by_some_ranks_or_none(rank, world)


@pytest.mark.slow
def test_models_with_and_without_buffers_end_each_step_identical_on_every_rank(tmp_path):
    run_group(_bn_worker, 2)


def _branches_used_by_some_ranks_or_none(rank: int, world: int) -> None:
    from elastic_mnist.worker.parallel import DataParallel

    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.never = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            return self.a(x) + self.b(x) if use_b else self.a(x)

    model = Branchy()
    replicas = DataParallel(model, world)
    replicas(torch.ones(2, 4), rank == 0).sum().backward()
    replicas.average_gradients()
    # Unused everywhere: no gradient, as at world size 1 (Adam leaves it alone); used by rank 0 only: the
    # average counts the other ranks as zeros, the same on every rank.
    assert model.never.weight.grad is None
    gathered = [torch.empty_like(model.b.weight) for _ in range(world)]
    dist.all_gather(gathered, model.b.weight.grad)
    assert all(torch.equal(gathered[0], g) for g in gathered) and gathered[0].abs().sum() > 0
