"""The ceiling: one process, data resident in tensors, no DDP, no checkpoints; same model, optimizer
and batch as the trainer.

    python -m bench.bare_loop --data-dir ../shared/data --steps 500

Prints one JSON line: {"samples_per_s": ..., "step_ms_median": ..., "steps": ...}. The median step time
is reported beside the rate because on a shared machine it is far less sensitive to bursts of load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from elastic_mnist.data import BatchPlan, load_split
from elastic_mnist.model import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--global-batch-size", type=int, default=128)
    args = parser.parse_args()
    train = load_split(args.data_dir, True)
    plan = BatchPlan(len(train), args.global_batch_size, seed=0)
    model = build_model(512, 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    t0 = last = 0.0
    step_s = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            t0 = last = time.perf_counter()
        idx = plan.global_indices(step)
        optimizer.zero_grad()
        F.nll_loss(model(train.images[idx]), train.labels[idx]).backward()
        optimizer.step()
        if step >= args.warmup:
            now = time.perf_counter()
            step_s.append(now - last)
            last = now
    rate = args.steps * args.global_batch_size / (time.perf_counter() - t0)
    print(json.dumps({"samples_per_s": rate, "step_ms_median": statistics.median(step_s) * 1000,
                      "steps": args.steps, "world_size": 1}), flush=True)


if __name__ == "__main__":
    main()
