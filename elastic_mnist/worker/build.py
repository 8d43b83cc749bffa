"""What a worker builds: once per process (device, data, model, optimizer, scheduler, scaler, the task's own
state) and once per round (journal, metrics, the checkpoint manager and the agreed state, this rank's share of
the data, the trainer). A worker kept across rounds builds the first once and the second at every round.

    python -m elastic_mnist.train --data-dir ../shared/data --epochs 1      # one process, one round
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elastic_mnist import job_secret
from elastic_mnist.compat import private as compat
from elastic_mnist.contract.errors import UserError
from elastic_mnist.data.inputs import build_inputs
from elastic_mnist.data.mnist import BatchPlan, Split, dataset_fingerprint
from elastic_mnist.distributed import DistEnv
from elastic_mnist.metrics import Metrics, check_log_dir
from elastic_mnist.runlog import RunLog
from elastic_mnist.state import format as checkpoint
from elastic_mnist.state.manager import CheckpointManager, Held, check_checkpoint_dir
from elastic_mnist.state.registry import Progress, RngState, Stateful
from elastic_mnist.worker.control import ControlPlane
from elastic_mnist.worker.step import ScalerState
from elastic_mnist.worker.task import RUNTIME_STATE, Task
from elastic_mnist.worker.trainer import Learner, Reporting, Trainer


@dataclass
class Process:
    """What a worker process builds once and keeps, whatever round it serves."""

    config: object
    task: Task
    device: torch.device
    data: tuple
    """(train, test) as the task gave them (tensor splits moved to the device once)."""
    plan: BatchPlan
    learner: Learner | None
    """The learner (sharded training: the last round's; None before the first)."""
    objects: dict[str, Stateful]
    """Every stateful object by name (the runtime's, then the task's): what a checkpoint holds."""
    fingerprint: dict
    key: bytes | None
    held: Held | None = None
    """Between rounds: the state the objects hold and who agreed on it (None: nothing agreed yet)."""
    marks: dict = field(default_factory=dict)
    """Unix times of this round's start-up phases (a process's first round: its own too), for the journal."""
    rounds: int = 0
    """Rounds this process has served (its journal tells them apart)."""


def build_process(config, task: Task, device: torch.device, marks: dict | None = None) -> Process:
    marks = {} if marks is None else marks
    check_log_dir(config.log_dir)
    train, test = task.datasets(config)
    if isinstance(train, Split) and isinstance(test, Split):
        train, test = train.to(device), test.to(device)  # once: a round's share indexes them where they are
    marks["data"] = time.time()
    plan = BatchPlan(len(train), config.global_batch_size, config.seed)
    # Sharded training builds its learner at every round, for that round's ranks: never whole here. Its modules
    # (a second and a half of imports) load now, before this node joins, not while a round waits for it.
    learner = None
    if config.parallel == "fsdp":
        compat.import_sharding()
    else:
        learner = _learner(task, task.build_model(config).to(device), config, plan.steps_per_epoch)
    # Before its agent joins (the process is built first): a node that cannot save ends alone (NodeLocalError);
    # after the task's own checks, so a task's mistake leaves nothing behind.
    check_checkpoint_dir(config)
    fingerprint = {**config.fingerprint(), **task.fingerprint(config), "dataset": dataset_fingerprint(train)}
    key = checkpoint.checkpoint_key(job_secret.from_env())  # None for a job without a secret
    marks["built"] = time.time()
    return Process(config, task, device, (train, test), plan, learner, registry_of(learner, config) if learner else {},
                   fingerprint, key, marks=marks)


def build_round(proc: Process, env: DistEnv, control: ControlPlane, stack: ExitStack,
                in_place: bool = False) -> Trainer:
    """This round's trainer, its objects holding the state every rank agreed on (restored, sent by a peer,
    or, for a worker kept across rounds, what it already holds)."""
    config, marks = proc.config, dict(proc.marks)
    runlog = stack.enter_context(RunLog(config.log_dir, config.sample_log, env.rank, env.world_size,
                                        env.restart_count, env.node, proc.rounds))
    proc.rounds += 1
    metrics = Metrics(env.rank, config.log_dir, journal=runlog)
    stack.callback(metrics.close)
    if config.parallel == "fsdp":  # imported here: DCP's import is a cost the replicated worker's start need not pay
        from elastic_mnist.state.sharded_manager import ShardedCheckpoints

        manager = ShardedCheckpoints(config, env, metrics, proc.fingerprint, proc.key, _sharded_round(proc))
    else:
        manager = CheckpointManager(config, env, metrics, proc.fingerprint, proc.key)
    stack.callback(manager.close)
    if proc.held is None:
        proc.objects["rng"].reset()  # a fresh run draws what an uninterrupted one would, whatever start-up drew
    manager.restore(proc.objects, proc.learner.progress, proc.plan.steps_per_epoch, proc.held)
    proc.held = None  # the objects belong to this round now
    marks["resumed"] = time.time()
    metrics.open_tensorboard(proc.learner.progress.step)
    inputs = build_inputs(*proc.data, proc.plan, env.world_size, env.rank, proc.device, config.num_workers)
    return Trainer(config, env, proc.learner, inputs, manager, Reporting(metrics, runlog, marks), control, in_place)


def build_trainer(config, env, task: Task, control: ControlPlane, stack: ExitStack, device=None,
                  marks: dict | None = None) -> Trainer:
    """Data, model, optimizer, scheduler, scaler, the task's own state and the checkpoint manager, restored
    from the newest state there is: a process and its one round at once. The worker's own path, and the
    tests' and benchmarks' in one process."""
    return build_round(build_process(config, task, device or torch.device("cpu"), marks), env, control, stack)


def _sharded_round(proc: Process):
    """This round's sharded learner, built for its ranks, replacing the last round's (whose state the round's
    agreement moves into it); the round's checkpoint manager's view of it."""
    from elastic_mnist.worker import sharded

    if not dist.is_initialized():
        raise UserError("--parallel fsdp runs under torchrun (for one process: torchrun --nproc-per-node 1 ...)")
    config, progress = proc.config, proc.learner.progress if proc.learner else Progress()
    proc.learner, proc.objects = None, {}  # the last round's rows go before this round's are made
    mesh = sharded.mesh_of(None, proc.device.type, f"round{proc.rounds}")
    proc.learner = sharded_learner(proc.task, config, mesh, proc.device, proc.plan.steps_per_epoch)
    proc.learner.progress = progress
    proc.objects = registry_of(proc.learner, config)
    return sharded.ShardedState({**proc.objects, "progress": progress}, proc.learner.model, proc.learner.optimizer,
                                initial=lambda: proc.task.build_model(config))


def sharded_learner(task: Task, config, mesh, device: torch.device, steps_per_epoch: int,
                    fresh: bool = False) -> Learner:
    """One round's learner under sharded training: the task's model wrapped for the round's `mesh` by Task.shard,
    with its optimizer, scheduler and scaler over the sharded parameters. Its rows are uninitialized until the
    round's state loads into them, and the model is never whole on this rank; `fresh` (a run's first start):
    built whole and seeded, as on every rank, and each rank keeps its rows."""
    from elastic_mnist.worker import sharded

    policy = sharded.precision_policy(config.precision)
    if fresh:
        model = task.shard(task.build_model(config).to(device), mesh, policy)
    else:
        model = sharded.empty_sharded(lambda: task.build_model(config), mesh, policy, device, task.shard)
    return _learner(task, model, config, steps_per_epoch)


def _learner(task: Task, model, config, steps_per_epoch: int) -> Learner:
    optimizer = task.build_optimizer(model, config)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"{type(task).__name__}.build_optimizer returned a {type(optimizer).__name__}, not a "
                        "torch.optim.Optimizer: return one (torch's LR schedulers and GradScaler need it)")
    scheduler = task.build_scheduler(optimizer, config, steps_per_epoch)
    scaler = ScalerState(config.precision, next(model.parameters()).device.type)
    return Learner(task, model, optimizer, scheduler, scaler)


def registry_of(learner: Learner, config) -> dict[str, Stateful]:
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
