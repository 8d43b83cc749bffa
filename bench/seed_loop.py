"""The seed article's DDP loop, the baseline we are measured against: torchvision MNIST decoded per
sample (PIL → ToTensor → Normalize) through a DataLoader with DistributedSampler, DDP with gloo.

    torchrun --standalone --nproc-per-node=1 -m bench.seed_loop --data-dir ../shared/data --steps 300

Prints one JSON line from rank 0: {"samples_per_s": ..., "step_ms_median": ..., "steps": ..., "world_size": ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms

from elastic_mnist.model import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--global-batch-size", type=int, default=128)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    dataset = datasets.MNIST(args.data_dir, train=True, download=False, transform=transform)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.global_batch_size // world, sampler=sampler)
    model = DDP(build_model(512, 0))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    step, epoch, t0, last, step_s = 0, 0, 0.0, 0.0, []
    while step < args.warmup + args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step == args.warmup:
                t0 = last = time.perf_counter()
            optimizer.zero_grad()
            F.nll_loss(model(x.view(len(x), -1)), y).backward()
            optimizer.step()
            if step >= args.warmup:  # loading the next batch counts: it is part of what a step costs
                now = time.perf_counter()
                step_s.append(now - last)
                last = now
            step += 1
            if step == args.warmup + args.steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - t0
    if rank == 0:
        rate = args.steps * args.global_batch_size / elapsed
        print(json.dumps({"samples_per_s": rate, "step_ms_median": statistics.median(step_s) * 1000,
                          "steps": args.steps, "world_size": world}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
