"""The worker entry point: parse config, join the group, resume, train, close.

    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=etcd --rdzv-endpoint=HOST:2379 --rdzv-id=JOB \\
        -m elastic_mnist.train --data-dir DATA --checkpoint-dir CKPT --log-dir RUNS
    python -m elastic_mnist.train --data-dir ../shared/data --epochs 1      # one process, no torchrun

Every start is a resume: torchrun re-runs this on every membership change, and each step below is
safe to repeat. Exit codes: 0 done (or stopped on our own SIGTERM), 2 bad input, 75 the group stopped
for a membership change (torchrun restarts us into the next rendezvous round).
"""

from __future__ import annotations

import io
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from elastic_mnist import checkpoint, distributed, state_sync
from elastic_mnist.checkpoint import CheckpointWriter
from elastic_mnist.config import parse_args
from elastic_mnist.data import SampleLog, load_split
from elastic_mnist.errors import UserError
from elastic_mnist.metrics import Metrics, process_age_s
from elastic_mnist.model import build_model
from elastic_mnist.trainer import Progress, StopRequest, Trainer, cpu_snapshot

EXIT_RESTART = 75  # EX_TEMPFAIL: "try again", which is what torchrun does with a failed worker


def _writes_checkpoints(config, env) -> bool:
    """Shared storage: global rank 0 writes. Node-local storage: every rank keeps its own copy."""
    return env.rank == 0 or config.checkpoint_storage == "local"


def snapshot_location(config, env) -> tuple[str, dict]:
    """This rank's in-memory snapshot dir and the origin stamped on its snapshots (empty: off)."""
    origin = {"run_id": env.run_id, "checkpoint_dir": os.path.abspath(config.checkpoint_dir)}
    if not (env.launched and config.snapshot_every and config.snapshot_dir):
        return "", origin  # a lone process has no job identity to tell its snapshots from others'
    safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in env.run_id)
    return os.path.join(config.snapshot_dir, safe_id, f"local{env.local_rank}"), origin


def _resume(config, env, metrics, fingerprint: dict):
    """Every rank offers its newest valid state; the newest wins and is sent to the ranks that lack it."""
    snapshot_dir, origin = snapshot_location(config, env)
    error, mine = None, None
    try:
        if _writes_checkpoints(config, env):
            checkpoint.ensure_writable(config.checkpoint_dir)
        mine = state_sync.best_local(config.checkpoint_dir, snapshot_dir, origin, metrics.warn)
    except UserError as e:
        error = str(e)
    state_sync.agree_errors(error, env.world_size)
    chosen, owner, sent_to = state_sync.agree_on_state(mine, env.rank, env.world_size)
    if chosen is None:
        return None, ""
    state = checkpoint.decode(chosen.blob, chosen.source)  # verifies the checksum of what was sent
    checkpoint.check_compatible(state, fingerprint, chosen.source)
    if _writes_checkpoints(config, env):
        state_sync.keep_durable_copy(chosen, config.checkpoint_dir)
    if sent_to:
        metrics.print0(f"[sync] step {chosen.step}: rank {owner} sent its state to ranks {sent_to}")
    return state, chosen.source


def _build(config, env, device, metrics, marks: dict):
    """Data, model and optimizer, restored from the newest checkpoint when there is one."""
    train, test = load_split(config.data_dir, True, config.download), load_split(config.data_dir, False)
    marks["data"] = time.time()
    fingerprint = {**config.fingerprint(), "dataset": train.fingerprint()}
    state, path = _resume(config, env, metrics, fingerprint)
    model = build_model(config.hidden, config.seed)
    progress = Progress()
    if state is not None:
        model.load_state_dict(state["model"])  # on CPU, before moving and wrapping in DDP
        torch.set_rng_state(state["rng"]["torch"])
        saved = state["progress"]
        progress = Progress(step=state["step"], resumes=saved["resumes"] + 1, train_time_s=saved["train_time_s"],
                            last_eval=saved["last_eval"], samples_per_s=saved["samples_per_s"])
        metrics.print0(
            f"[resume] step {state['step']} (epoch {state['epoch']}, position {state['position']}) from {path}, "
            f"saved at world size {state['world_size']}; now world size {env.world_size}, "
            f"torchrun restart {env.restart_count}")
    else:
        metrics.print0(f"[start] fresh run at world size {env.world_size} (no checkpoint in {config.checkpoint_dir})")
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    return model, optimizer, train.to(device), test.to(device), progress, fingerprint


def _writers(config, env):
    """Checkpoint writer, split-brain fence, snapshot writer (each None where this rank has none)."""
    writer = fence = snapshots = None
    if _writes_checkpoints(config, env):
        writer = CheckpointWriter(config.checkpoint_dir, config.keep_checkpoints)
    if env.rank == 0:
        token = checkpoint.claim_generation(config.checkpoint_dir, env.world_size)
        fence = lambda: checkpoint.generation_is(config.checkpoint_dir, token)  # noqa: E731
    snapshot_dir, origin = snapshot_location(config, env)
    if snapshot_dir:
        snapshots = CheckpointWriter(snapshot_dir, keep=2)
    return writer, fence, snapshots, origin


def _train(trainer: Trainer, config, env, stop, metrics) -> int:
    """Train to the end; the exit code tells torchrun whether to restart us."""
    try:
        summary = trainer.train()
    except Exception as e:
        if env.world_size == 1 or not is_collective_failure(e):
            raise
        where = trainer.save_on_failure()
        metrics.warn(f"collective failed at step {trainer.progress.step} (a peer died or froze): "
                     f"{str(e).splitlines()[0][:200]}; state saved ({where}); exiting for torchrun to restart")
        return EXIT_RESTART
    if trainer.stopped_early:
        return 0 if stop.requested else EXIT_RESTART
    _write_final(config, env, trainer.model, summary, metrics)
    return 0


def run(config, env, stop, marks: dict) -> int:
    device = distributed.init(env, config.backend, config.collective_timeout)
    marks["process_group"] = time.time()
    metrics = sample_log = writer = snapshots = None
    try:
        config.check_world_size(env.world_size)
        metrics = Metrics(env.rank, config.log_dir)
        model, optimizer, train, test, progress, fingerprint = _build(config, env, device, metrics, marks)
        marks["resumed"] = time.time()
        metrics.open_tensorboard(progress.step)
        writer, fence, snapshots, origin = _writers(config, env)
        if config.sample_log:
            sample_log = SampleLog(config.sample_log, env.rank, env.world_size, env.restart_count)
        trainer = Trainer(config, env.rank, env.world_size, model, optimizer, train, test, metrics, progress,
                          writer=writer, sample_log=sample_log, stop=stop, restart_count=env.restart_count,
                          fingerprint=fingerprint, run_id=env.run_id, startup_marks=marks, fence=fence,
                          snapshots=snapshots, origin=origin)
        return _train(trainer, config, env, stop, metrics)
    finally:
        for w in (writer, snapshots):
            if w is not None:
                w.wait()
        if sample_log is not None:
            sample_log.close()
        if metrics is not None:
            metrics.close()
        distributed.close()


def is_collective_failure(e: BaseException) -> bool:
    """A lost or frozen peer, as gloo/nccl report it (not a bug in our code)."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in ("gloo", "NCCL", "Connection", "imed out"))


def _write_final(config, env, model, summary: dict, metrics) -> None:
    if env.rank != 0:
        return
    buf = io.BytesIO()
    torch.save(cpu_snapshot(model.state_dict()), buf)
    checkpoint.write_durable(os.path.join(config.log_dir, "model.pt"), buf.getvalue(), replace=True)
    metrics.write_summary(summary)
    metrics.print0(f"[done] step {summary['global_step']} test_accuracy {summary['test_accuracy']:.4f} "
                   f"samples/s {summary['samples_per_s']:.0f}; summary in {config.log_dir}/summary.json")


@record
def main(argv: list[str] | None = None) -> int:
    marks = {"process_start": time.time() - process_age_s(), "imports": time.time()}
    env = distributed.read_env()
    if env.launched:
        distributed.die_with_parent()
    stop = StopRequest()
    stop.install()  # before the slow start-up: a preemption during it is still a graceful stop
    try:
        config = parse_args(argv)
        return run(config, env, stop, marks)
    except UserError as e:
        print(f"elastic-mnist train: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
