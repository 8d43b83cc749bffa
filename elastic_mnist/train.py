"""The worker entry point: parse config, join the group, resume, train, close.

    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=etcd-v3 --rdzv-endpoint=HOST:2379 --rdzv-id=JOB \\
        -m elastic_mnist.train --data-dir DATA --checkpoint-dir CKPT --log-dir RUNS
    python -m elastic_mnist.train --data-dir ../shared/data --epochs 1      # one process, no torchrun

Every start is a resume: torchrun re-runs this on every membership change, and each step below is
safe to repeat. Exit codes: 0 done (or stopped on our own SIGTERM), 2 bad input, 75 the group stopped
for a membership change (torchrun restarts us into the next rendezvous round).
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from contextlib import ExitStack

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from elastic_mnist import checkpoint, distributed, procs
from elastic_mnist.checkpoints import CheckpointManager, cpu_snapshot
from elastic_mnist.config import parse_args
from elastic_mnist.data import load_split
from elastic_mnist.errors import UserError
from elastic_mnist.metrics import Metrics, process_age_s
from elastic_mnist.model import build_model
from elastic_mnist.runlog import RunLog
from elastic_mnist.trainer import Reporting, StopRequest, Trainer

EXIT_RESTART = 75  # EX_TEMPFAIL: "try again", which is what torchrun does with a failed worker


def _build(config, env, device, stack: ExitStack, stop: StopRequest, marks: dict) -> Trainer:
    """Data, model, optimizer and the checkpoint manager, restored from the newest state there is."""
    metrics = Metrics(env.rank, config.log_dir)
    stack.callback(metrics.close)
    train, test = load_split(config.data_dir, True, config.download), load_split(config.data_dir, False)
    marks["data"] = time.time()
    model = build_model(config.hidden, config.seed).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    manager = CheckpointManager(config, env, metrics, {**config.fingerprint(), "dataset": train.fingerprint()})
    stack.callback(manager.close)
    progress = manager.restore(model, optimizer, len(train) // config.global_batch_size)
    marks["resumed"] = time.time()
    metrics.open_tensorboard(progress.step)
    runlog = stack.enter_context(RunLog(config.log_dir, config.sample_log, env.rank, env.world_size,
                                        env.restart_count))
    return Trainer(config, env, model, optimizer, (train.to(device), test.to(device)), manager,
                   Reporting(metrics, runlog, marks), stop)


def _train(trainer: Trainer, config, env) -> int:
    """Train to the end; the exit code tells torchrun whether to restart us."""
    try:
        summary = trainer.train()
    except Exception as e:
        if env.world_size == 1 or not is_collective_failure(e):
            raise
        where = trainer.save_on_failure()
        trainer.metrics.warn(f"collective failed at step {trainer.progress.step} (a peer died or froze): "
                             f"{str(e).splitlines()[0][:200]}; state saved ({where}); exiting for torchrun to restart")
        return EXIT_RESTART
    if trainer.stopped_early:
        return 0 if trainer.stop.requested else EXIT_RESTART
    _write_final(config, env, trainer, summary)
    return 0


def run(config, env, stop: StopRequest, marks: dict) -> int:
    with ExitStack() as stack:
        device = distributed.init(env, config.backend, config.collective_timeout)
        stack.callback(distributed.close)
        marks["process_group"] = time.time()
        config.check_world_size(env.world_size)
        trainer = _build(config, env, device, stack, stop, marks)
        return _train(trainer, config, env)


def is_collective_failure(e: BaseException) -> bool:
    """A lost or frozen peer, as gloo/nccl report it (not a bug in our code)."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in ("gloo", "NCCL", "Connection", "imed out"))


def _write_final(config, env, trainer: Trainer, summary: dict) -> None:
    trainer.checkpoints.mark_finished(summary)
    if env.rank != 0:
        return
    buf = io.BytesIO()
    torch.save(cpu_snapshot(trainer.model.state_dict()), buf)
    checkpoint.write_durable(os.path.join(config.log_dir, "model.pt"), buf.getvalue(), replace=True)
    trainer.metrics.write_summary(summary)
    trainer.metrics.print0(f"[done] step {summary['global_step']} test_accuracy {summary['test_accuracy']:.4f} "
                           f"samples/s {summary['samples_per_s']:.0f}; summary in {config.log_dir}/summary.json")


@record
def main(argv: list[str] | None = None) -> int:
    marks = {"process_start": time.time() - process_age_s(), "imports": time.time()}
    env = distributed.read_env()
    stop = StopRequest()
    stop.install()  # before the slow start-up: a preemption during it is still a graceful stop
    if env.launched:
        # If our torchrun agent dies, stop at the next step boundary with the group and save (SIGHUP),
        # rather than die with the steps since the last snapshot (SIGKILL).
        procs.set_parent_death_signal(signal.SIGHUP)
    try:
        config = parse_args(argv)
        stop.orphan_grace_s = config.collective_timeout + 30  # the agreement, then one blocking save
        return run(config, env, stop, marks)
    except UserError as e:
        print(f"elastic-mnist train: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
