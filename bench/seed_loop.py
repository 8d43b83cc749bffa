"""The seed article's DDP loop, the baseline we are measured against: torchvision MNIST decoded per
sample (PIL → ToTensor → Normalize) through a DataLoader with DistributedSampler, DDP with gloo; timed
by the trainer's own step timer (metrics.Throughput), so loading the next batch counts as in ours.

    torchrun --standalone --nproc-per-node=1 -m bench.seed_loop --data-dir ../shared/data --steps 300

Prints one JSON line from rank 0: {"samples_per_s": ..., "step_ms_median": ..., "steps": ..., "world_size": ...}.
"""

from __future__ import annotations

import itertools
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms

from bench.bare_loop import loop_parser
from elastic_mnist.metrics import Throughput
from elastic_mnist.worker.model import build_model


def batches(loader: DataLoader, sampler: DistributedSampler):
    """The loader's batches epoch after epoch, reshuffled each epoch as the seed does."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def main() -> None:
    args = loop_parser("the seed article's DDP loop").parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    dataset = datasets.MNIST(args.data_dir, train=True, download=False, transform=transform)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.global_batch_size // world, sampler=sampler)
    model = DDP(build_model(512, 0))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    timer = Throughput(args.warmup)
    for x, y in itertools.islice(batches(loader, sampler), args.warmup + args.steps):
        optimizer.zero_grad()
        F.nll_loss(model(x.view(len(x), -1)), y).backward()
        optimizer.step()
        timer.step(args.global_batch_size)
    if rank == 0:
        print(json.dumps(timer.result(world_size=world)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
