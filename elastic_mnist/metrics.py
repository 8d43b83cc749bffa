"""Rank-0 output: progress lines, TensorBoard scalars, summary.json. Other ranks print only warnings.

    tensorboard --logdir runs      # reads what Metrics writes
"""

from __future__ import annotations

import json
import os
import sys
import time


class Metrics:
    def __init__(self, rank: int, log_dir: str):
        self.rank = rank
        self.log_dir = log_dir
        self._writer = None

    def open_tensorboard(self, resume_step: int) -> None:
        if self.rank != 0:
            return
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(self.log_dir, exist_ok=True)
        # purge_step drops events past the resume point: that work was lost and is being redone.
        self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=resume_step or None)

    def print0(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def warn(self, msg: str) -> None:
        print(f"[rank {self.rank}] {msg}", file=sys.stderr, flush=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self._writer is not None:
            for tag, value in values.items():
                self._writer.add_scalar(tag, value, step)

    def write_summary(self, summary: dict) -> None:
        if self.rank != 0:
            return
        path = os.path.join(self.log_dir, "summary.json")
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class Throughput:
    """Samples/s over this (re)start, after a few warm-up steps so start-up cost does not skew it."""

    def __init__(self, warmup_steps: int = 5):
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.samples = 0
        self._t0: float | None = None

    def step(self, samples: int) -> None:
        self.steps += 1
        if self.steps == self.warmup_steps:
            self._t0 = time.perf_counter()
        elif self.steps > self.warmup_steps:
            self.samples += samples

    def rate(self) -> float:
        if self._t0 is None or self.samples == 0:
            return 0.0
        return self.samples / max(time.perf_counter() - self._t0, 1e-9)


def process_age_s() -> float:
    """Seconds since this process started (kernel start time, so interpreter and import time count)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return time.time() - (boot + start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, StopIteration):
        return float("nan")
