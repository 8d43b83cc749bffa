"""The ceiling: one process, data resident in tensors, no DDP, no checkpoints; same model, optimizer
and batch as the trainer, timed by the trainer's own step timer (metrics.Throughput).

    python -m bench.bare_loop --data-dir ../shared/data --steps 500

Prints one JSON line: {"samples_per_s": ..., "step_ms_median": ..., "steps": ..., "world_size": 1}. The
median step time is reported beside the rate because on a shared machine it is far less sensitive to
bursts of load.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from elastic_mnist.data.mnist import BatchPlan, load_split
from elastic_mnist.metrics import Throughput
from elastic_mnist.worker.model import build_model


def loop_parser(description: str) -> argparse.ArgumentParser:
    """The flags every measured loop takes (bench.throughput passes the same to each)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--steps", type=int, default=500, help="measured steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=Throughput.WARMUP_STEPS, help="steps left out of the numbers")
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU check")
    return parser


def main() -> None:
    args = loop_parser("bare single-process loop").parse_args()
    train = load_split(args.data_dir, True).to(torch.device(args.device))
    plan = BatchPlan(len(train), args.global_batch_size, seed=0)
    model = build_model(512, 0).to(args.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    timer = Throughput(args.warmup)
    for step in range(args.warmup + args.steps):
        idx = plan.global_indices(step).to(args.device)
        optimizer.zero_grad()
        F.nll_loss(model(train.images[idx]), train.labels[idx]).backward()
        optimizer.step()
        timer.step(args.global_batch_size)
    print(json.dumps(timer.result(world_size=1)), flush=True)


if __name__ == "__main__":
    main()
