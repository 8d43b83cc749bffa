"""The worker entry point: parse config, join the group, resume, train, close.

    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=etcd-v3 --rdzv-endpoint=HOST:2379 --rdzv-id=JOB \\
        -m elastic_mnist.train --data-dir DATA --checkpoint-dir CKPT --log-dir RUNS
    python -m elastic_mnist.train --data-dir ../shared/data --epochs 1      # one process, no torchrun

Every start is a resume: torchrun re-runs this on every membership change, and each step below is
safe to repeat. Exit codes (elastic_mnist.exit_codes): 0 done (or stopped on our own SIGTERM), 2 bad input, 75 the group
stopped for a membership change (torchrun restarts us into the next rendezvous round), 74 a peer was lost and
the save of the last completed step did not finish (worker/failure.py).
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from contextlib import ExitStack
from typing import NoReturn

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from elastic_mnist import agent_link, distributed, exit_codes, job_secret, procs
from elastic_mnist.config import parse_args
from elastic_mnist.data.inputs import build_inputs
from elastic_mnist.data.mnist import BatchPlan, dataset_fingerprint
from elastic_mnist.errors import UserError
from elastic_mnist.metrics import Metrics, check_log_dir, process_age_s
from elastic_mnist.runlog import RunLog
from elastic_mnist.state import format as checkpoint
from elastic_mnist.state.manager import CheckpointManager
from elastic_mnist.state.registry import RngState, Stateful, cpu_snapshot
from elastic_mnist.worker import stop as stop_signals
from elastic_mnist.worker.control import ControlPlane
from elastic_mnist.worker.step import ScalerState
from elastic_mnist.worker.stop import StopRequest
from elastic_mnist.worker.task import RUNTIME_STATE, MnistMLP, Task
from elastic_mnist.worker.trainer import Learner, Reporting, Trainer


def build_trainer(config, env, task: Task, control: ControlPlane, stack: ExitStack, device=None,
                  marks: dict | None = None) -> Trainer:
    """Data, model, optimizer, scheduler, scaler, the task's own state and the checkpoint manager, restored
    from the newest state there is. The one way a Trainer is built: the worker below and the tests and
    benchmarks in one process alike."""
    device, marks = device or torch.device("cpu"), {} if marks is None else marks
    check_log_dir(config.log_dir)
    runlog = stack.enter_context(RunLog(config.log_dir, config.sample_log, env.rank, env.world_size,
                                        env.restart_count, env.node))
    metrics = Metrics(env.rank, config.log_dir, journal=runlog)
    stack.callback(metrics.close)
    train, test = task.datasets(config)
    marks["data"] = time.time()
    plan = BatchPlan(len(train), config.global_batch_size, config.seed)
    model = task.build_model(config).to(device)
    learner = _learner(task, model, config, plan.steps_per_epoch)
    fingerprint = {**config.fingerprint(), **task.fingerprint(config), "dataset": dataset_fingerprint(train)}
    key = checkpoint.checkpoint_key(job_secret.from_env())  # None for a job without a secret
    manager = CheckpointManager(config, env, metrics, fingerprint, key)
    stack.callback(manager.close)
    manager.restore(_registry(learner, config), learner.progress, plan.steps_per_epoch)
    marks["resumed"] = time.time()
    metrics.open_tensorboard(learner.progress.step)
    inputs = build_inputs(train, test, plan, env.world_size, env.rank, device, config.num_workers)
    return Trainer(config, env, learner, inputs, plan, manager, Reporting(metrics, runlog, marks), control)


def _learner(task: Task, model, config, steps_per_epoch: int) -> Learner:
    optimizer = task.build_optimizer(model, config)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"{type(task).__name__}.build_optimizer returned a {type(optimizer).__name__}, not a "
                        "torch.optim.Optimizer: return one (torch's LR schedulers and GradScaler need it)")
    scheduler = task.build_scheduler(optimizer, config, steps_per_epoch)
    scaler = ScalerState(config.precision, next(model.parameters()).device.type)
    return Learner(task, model, optimizer, scheduler, scaler)


def _registry(learner: Learner, config) -> dict[str, Stateful]:
    """Every stateful object, by name: the runtime's, then the task's own (Task.extra_state)."""
    state: dict[str, Stateful] = {"model": learner.model, "optimizer": learner.optimizer, "scaler": learner.scaler,
                                  "rng": RngState(config.seed)}
    if learner.scheduler is not None:
        state["scheduler"] = learner.scheduler
    extra = learner.task.extra_state(learner.model, learner.optimizer, config)
    taken = sorted(set(extra) & set(RUNTIME_STATE))
    if taken:
        raise UserError(f"{type(learner.task).__name__}.extra_state uses the name(s) {', '.join(taken)}, which the "
                        f"runtime registers itself ({', '.join(RUNTIME_STATE)}): pick other names")
    return {**state, **extra}


def _train(trainer: Trainer, config, env) -> int:
    """Train to the end; the exit code tells torchrun whether to restart us."""
    try:
        summary = trainer.train()
    except Exception as e:
        where = trainer.handle_failure(e) if env.world_size > 1 else None
        if where is None:
            raise
        trainer.metrics.warn(f"collective failed at step {trainer.progress.step} (a peer died or froze): "
                             f"{str(e).splitlines()[0][:200]}; state saved ({where}); exiting for torchrun to restart")
        return exit_codes.RESTART
    if trainer.stopped_early:
        return exit_codes.OK if trainer.stop.requested else exit_codes.RESTART
    _write_final(config, env, trainer, summary)
    return exit_codes.OK


def pay_startup_cost(seconds: float, stop: StopRequest) -> None:
    """--startup-cost: what a GPU job spends at every start (CUDA context, NCCL init, model load) that
    this CPU MLP does not, so a replay's recoveries cost what a real job's would. A preemption notice
    cuts it short (and `run` then exits: nothing is loaded yet)."""
    deadline = time.monotonic() + seconds
    while not stop.requested and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.1))


def run(config, env, stop: StopRequest, task: Task, marks: dict) -> int:
    # Until the state is restored (after the group forms) a stop has nothing to save: the newest state
    # is in its files. Exiting at once spares torchrun's 30 s wait on a worker that would form a group
    # with peers that are leaving. From the restore on, a stop saves at the first step boundary.
    with stop.leave_at_once("before the process group formed"):
        pay_startup_cost(config.startup_cost, stop)
        marks["startup_cost"] = time.time()
        try:
            device = distributed.init(env, config.backend, config.collective_timeout, config.connect_timeout)
        except distributed.GroupFormationError as e:
            # Nothing trained, nothing to save: torchrun's next round is formed from who can reach whom.
            print(f"elastic-mnist train: {e}; exiting for torchrun to form a new round", file=sys.stderr, flush=True)
            return exit_codes.RESTART
    with ExitStack() as stack:
        stack.callback(distributed.close)
        marks["process_group"] = time.time()
        config.check_world_size(env.world_size)
        control = ControlPlane(env.world_size, config, stop, env.peer_beacons)
        stack.callback(control.leave)
        return _train(build_trainer(config, env, task, control, stack, device, marks), config, env)


def _write_final(config, env, trainer: Trainer, summary: dict) -> None:
    trainer.checkpoints.mark_finished(summary)
    if env.rank != 0:
        return
    trainer.metrics.mark_outputs()
    buf = io.BytesIO()
    torch.save(cpu_snapshot(trainer.model.state_dict()), buf)
    checkpoint.write_durable(os.path.join(config.log_dir, "model.pt"), buf.getvalue(), replace=True)
    trainer.metrics.write_summary(summary)
    trainer.metrics.event("done", f"[done] step {summary['global_step']} test_accuracy "
                          f"{summary['test_accuracy']:.4f} samples/s {summary['samples_per_s']:.0f}; summary in "
                          f"{config.log_dir}/summary.json", step=summary["global_step"],
                          test_accuracy=summary["test_accuracy"])


@record
def main(argv: list[str] | None = None, task: Task | None = None) -> int:
    """The worker; `task` is what is trained (default: the MNIST MLP). Your own model: examples/."""
    marks = {"process_start": time.time() - process_age_s(), "imports": time.time()}
    env = distributed.read_env()
    stop = stop_signals.for_process()  # installed before the slow start-up (by -m elastic_mnist.train: before
    # torch loads): a preemption during it is still a graceful stop
    if env.launched and procs.STARTED_AT_ENV not in os.environ:  # a warm child's parent is the warm process,
        # which set this up at the fork (warm/child.py)
        # If our torchrun agent dies, stop at the next step boundary with the group and save (SIGHUP),
        # rather than die with the steps since the last snapshot (SIGKILL).
        procs.set_parent_death_signal(signal.SIGHUP)
    try:
        config = parse_args(argv)
        stop.set_orphan_grace(config.collective_timeout + 30)  # the agreement, then one blocking save
        return run(config, env, stop, task or MnistMLP(), marks)
    except UserError as e:
        # A configuration error: no restart can help. Under an etcd-v3 agent it ends the whole job, once
        # (agent_link.py); elsewhere torchrun's retries meet the same line.
        print(f"elastic-mnist train: error: {e}", file=sys.stderr, flush=True)
        agent_link.report_config_error(str(e))
        return exit_codes.PERMANENT


def launch(task: Task | None = None) -> NoReturn:
    """Run the worker, then end the process at once. Every writer is closed and flushed by then, and the
    interpreter's own teardown (collecting torch's module graph) costs ~2 s on the path of every
    membership change, where torchrun waits for this process to go."""
    code = main(task=task)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    launch()
