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

from elastic_mnist import checkpoint, distributed
from elastic_mnist.checkpoint import CheckpointWriter
from elastic_mnist.config import parse_args
from elastic_mnist.data import SampleLog, load_split
from elastic_mnist.errors import UserError
from elastic_mnist.metrics import Metrics, process_age_s
from elastic_mnist.model import build_model
from elastic_mnist.trainer import Progress, StopRequest, Trainer, cpu_snapshot

EXIT_RESTART = 75  # EX_TEMPFAIL: "try again", which is what torchrun does with a failed worker


def _resume(config, env, metrics, fingerprint: dict):
    """Rank 0 picks the newest valid checkpoint; everyone loads that same file (on CPU)."""
    verdict = [None]
    if env.rank == 0:
        try:
            checkpoint.ensure_writable(config.checkpoint_dir)
            found = checkpoint.load_latest(config.checkpoint_dir, warn=metrics.warn)
            if found is not None:
                checkpoint.check_compatible(found[0], fingerprint, found[1])
            verdict = [("ok", found[1] if found else "")]
        except UserError as e:
            verdict = [("error", str(e))]
    dist.broadcast_object_list(verdict, src=0)
    kind, value = verdict[0]
    if kind == "error":
        raise UserError(value)
    if not value:
        return None, ""
    if env.rank == 0:
        return found[0], value
    with open(value, "rb") as f:
        return checkpoint.decode(f.read(), value), value


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


def run(config, env, stop, marks: dict) -> int:
    device = distributed.init(env, config.backend, config.collective_timeout)
    marks["process_group"] = time.time()
    metrics = sample_log = writer = None
    try:
        config.check_world_size(env.world_size)
        metrics = Metrics(env.rank, config.log_dir)
        model, optimizer, train, test, progress, fingerprint = _build(config, env, device, metrics, marks)
        marks["resumed"] = time.time()
        metrics.open_tensorboard(progress.step)
        writer = fence = None
        if env.rank == 0:
            writer = CheckpointWriter(config.checkpoint_dir, config.keep_checkpoints)
            token = checkpoint.claim_generation(config.checkpoint_dir, env.world_size)
            fence = lambda: checkpoint.generation_is(config.checkpoint_dir, token)  # noqa: E731
        if config.sample_log:
            sample_log = SampleLog(config.sample_log, env.rank, env.world_size, env.restart_count)
        trainer = Trainer(config, env.rank, env.world_size, model, optimizer, train, test, metrics, progress,
                          writer=writer, sample_log=sample_log, stop=stop, restart_count=env.restart_count,
                          fingerprint=fingerprint, run_id=env.run_id, startup_marks=marks, fence=fence)
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
        _write_final(config, env, model, summary, metrics)
        return 0
    finally:
        if writer is not None:
            writer.wait()
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
