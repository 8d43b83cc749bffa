"""Where a checkpoint's cost goes, measured in one process with the trainer's own code: the snapshot
that blocks training (CheckpointManager.capture), the background work (encode = torch.save + sha256, then the
durable write), and how much slower training steps run while that background write is in flight.

    python -m bench.save_cost --data-dir ../shared/data --saves 10

Prints one JSON line. `extra_ms_per_save` = blocking snapshot + the slowdown of the steps that overlap
the writer thread (against 20 steps just before each save); `cost_at_interval` = that over --interval
steps of undisturbed training; `cost_bound_no_idle_core` = all the save's CPU time over the same, what
it costs when no other core is free to run the writer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack

from elastic_mnist.config import TrainConfig
from elastic_mnist.distributed import DistEnv
from elastic_mnist.state.format import encode, path_for, write_durable
from elastic_mnist.state.writer import CheckpointWriter
from elastic_mnist.worker.build import build_trainer
from elastic_mnist.worker.control import ControlPlane
from elastic_mnist.worker.task import MnistMLP
from elastic_mnist.worker.trainer import Trainer


def _trainer(data_dir: str, work: str, stack: ExitStack) -> Trainer:
    """The worker's own trainer (one process); its saves are what is measured, so it writes into `work`."""
    config = TrainConfig(data_dir=data_dir, checkpoint_dir=work, log_dir=work)
    return build_trainer(config, DistEnv(), MnistMLP(), ControlPlane(1, config), stack)


def _step(trainer: Trainer) -> float:
    t0 = time.perf_counter()
    trainer.forward_backward(trainer.progress.step)
    trainer.optimizer.step()
    trainer.progress.step += 1
    return (time.perf_counter() - t0) * 1000


def _timed(fn, n: int) -> tuple[float, float]:
    """Median wall ms and median thread-CPU ms of fn()."""
    wall, cpu = [], []
    for _ in range(n):
        w, c = time.perf_counter(), time.thread_time()
        fn()
        wall.append((time.perf_counter() - w) * 1000)
        cpu.append((time.thread_time() - c) * 1000)
    return statistics.median(wall), statistics.median(cpu)


def measure(data_dir: str, saves: int, interval: int, where: str | None = None) -> dict:
    work = tempfile.mkdtemp(prefix="save-cost-", dir=where)
    try:
        with ExitStack() as stack:
            return _measure(_trainer(data_dir, work, stack), work, saves, interval)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(trainer: Trainer, work: str, saves: int, interval: int) -> dict:
    for _ in range(20):  # Adam state exists and the allocator is warm, as mid-run
        _step(trainer)
    state = trainer.checkpoints.capture()
    blob = encode(state)
    state_ms, state_cpu = _timed(trainer.checkpoints.capture, saves)
    encode_ms, encode_cpu = _timed(lambda: encode(state), saves)
    write_ms, write_cpu = _timed(lambda: write_durable(f"{work}/probe-{time.perf_counter_ns()}", blob), saves)
    writer, alone, overlapped, per_save, blocks = CheckpointWriter(work, keep=2), [], [], [], []
    for i in range(saves):
        # A baseline right before each save: the shared machine's load drifts, so compare like with like.
        baseline = [_step(trainer) for _ in range(20)]
        t0 = time.perf_counter()
        writer.save(trainer.checkpoints.capture(), 10_000 + i)
        blocked = (time.perf_counter() - t0) * 1000
        blocks.append(blocked)
        during = []
        while not _written(work, 10_000 + i) and len(during) < 1000:  # steps that overlap the write
            during.append(_step(trainer))
        writer.wait()
        alone += baseline
        overlapped += during
        per_save.append(blocked + sum(during) - len(during) * statistics.median(baseline))
    step_alone, extra = statistics.median(alone), statistics.median(per_save)
    behind = _behind_another_write(trainer, work, saves)
    background_cpu = encode_cpu + write_cpu
    return {"state_bytes": len(blob), "snapshot_ms": state_ms, "snapshot_cpu_ms": state_cpu,
            # Snapshot + handing it to the writer's queue, as the checkpoint manager times it: the writer
            # thread wakes and runs Python (pickling) at once, so the training thread may wait for the GIL.
            "save_call_ms": statistics.median(blocks), "save_call_ms_max": max(blocks),
            "switch_interval_ms": sys.getswitchinterval() * 1000, "save_call_ms_behind_another_write": behind,
            "encode_ms": encode_ms, "encode_cpu_ms": encode_cpu, "write_ms": write_ms, "write_cpu_ms": write_cpu,
            "step_ms_alone": step_alone,
            "step_ms_during_write": statistics.median(overlapped) if overlapped else None,
            "steps_overlapping_a_write": len(overlapped) / saves, "extra_ms_per_save": extra,
            "interval": interval, "cost_at_interval": extra / (interval * step_alone),
            # With no idle core (a busy shared machine) training pays for all the writer's CPU time.
            "cost_bound_no_idle_core": (state_cpu + background_cpu) / (interval * step_alone)}


def _written(directory: str, step: int) -> bool:
    """The writer's file appears (published complete) only when its write is done."""
    return os.path.exists(path_for(directory, step))


def _behind_another_write(trainer: Trainer, work: str, saves: int) -> float:
    """The save call while the other writer is still busy (a snapshot while the last checkpoint is
    being written, or the reverse): the two writer threads and training share the GIL."""
    first, second, calls = CheckpointWriter(f"{work}/a", keep=2), CheckpointWriter(f"{work}/b", keep=2), []
    for i in range(saves):
        first.save(trainer.checkpoints.capture(), 20_000 + i)
        t0 = time.perf_counter()
        second.save(trainer.checkpoints.capture(), 20_000 + i)
        calls.append((time.perf_counter() - t0) * 1000)
        first.wait()
        second.wait()
    return statistics.median(calls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--interval", type=int, default=100, help="steps between saves, for cost_at_interval")
    parser.add_argument("--dir", default=None, help="where the probe writes (default: the system temp dir)")
    args = parser.parse_args()
    print(json.dumps(measure(args.data_dir, args.saves, args.interval, args.dir)), flush=True)


if __name__ == "__main__":
    main()
