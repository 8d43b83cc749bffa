"""Uneven shards: 128 samples over 3 ranks (43/43/42). The DDP-averaged gradient must equal the
single-process gradient of the same global batch."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_mnist.config import TrainConfig
from elastic_mnist.data import Split
from elastic_mnist.distributed import DistEnv
from elastic_mnist.trainer import in_process_trainer


def _split(n: int = 600) -> Split:
    gen = torch.Generator().manual_seed(7)
    return Split(torch.randn(n, 784, generator=gen), torch.randint(0, 10, (n,), generator=gen))


def _grads(rank: int, world: int, step: int) -> list[torch.Tensor]:
    config = TrainConfig(global_batch_size=128, log_dir="")
    trainer = in_process_trainer(config, _split(), _split(50), DistEnv(rank=rank, world_size=world), writes=False)
    trainer.forward_backward(step)
    return [p.grad.clone() for p in trainer.model.parameters()]


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        torch.save(_grads(rank, world, step=3), os.path.join(out_dir, f"grads{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_gradient_over_three_uneven_ranks_equals_single_process(tmp_path):
    mp.spawn(_worker, args=(3, str(tmp_path / "store"), str(tmp_path)), nprocs=3, join=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        expected = _grads(0, 1, step=3)
    finally:
        dist.destroy_process_group()
    for rank in range(3):
        got = torch.load(tmp_path / f"grads{rank}.pt", weights_only=True)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
