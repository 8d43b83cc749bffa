"""The training loop: world-size-invariant batches (the step's math, with precision, accumulation and
clipping, is worker/step.py), the per-step agreement on the control plane, epoch-end evaluation, and
what a rank does when a peer is lost. Built by worker/train.py's build_trainer; knows nothing of etcd,
and asks the checkpoint manager (state/manager.py) what to save instead of assembling checkpoints itself.

    python -m elastic_mnist.train --data-dir ../shared/data --epochs 1
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from elastic_mnist import agent_link, distributed
from elastic_mnist.config import TrainConfig
from elastic_mnist.distributed import DistEnv
from elastic_mnist.metrics import Metrics, Throughput, process_age_s
from elastic_mnist.runlog import RunLog
from elastic_mnist.state.manager import CheckpointManager
from elastic_mnist.state.registry import Progress
from elastic_mnist.worker.control import ControlPlane
from elastic_mnist.worker.failure import Bounds, FailureHandoff, Handled
from elastic_mnist.worker.fault_points import FaultPoints
from elastic_mnist.worker.parallel import DataParallel
from elastic_mnist.worker.step import ScalerState, StepMath
from elastic_mnist.worker.stop import verdict as stop_verdict
from elastic_mnist.worker.task import Task


@dataclass
class Learner:
    """What is trained: the task (loss, what counts as correct), its model, optimizer, LR scheduler and
    GradScaler, and how far it got (the one Progress of this process, which the checkpoint manager loads
    in place)."""

    task: Task
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    scaler: ScalerState
    progress: Progress = field(default_factory=Progress)


@dataclass
class Reporting:
    """Where a trainer reports: rank-0 output and TensorBoard, the run log, start-up phase times."""

    metrics: Metrics
    runlog: RunLog | None = None
    startup_marks: dict = field(default_factory=dict)
    """Unix times of start-up phases (process start, imports, group, data, resume) for the journal."""


class Trainer:
    def __init__(self, config: TrainConfig, env: DistEnv, learner: Learner, inputs, checkpoints: CheckpointManager,
                 report: Reporting, control: ControlPlane, in_place: bool = False):
        """`in_place`: this process outlives its round (worker/life.py): a lost peer ends the round in memory
        instead of the process, and a stop leaves the state in memory instead of saving it."""
        self.config, self.env, self.rank, self.world_size = config, env, env.rank, env.world_size
        self.task, self.model, self.optimizer = learner.task, learner.model, learner.optimizer
        self.replicas = _replicas(config, self.model, env.world_size)
        self.math = StepMath(config, learner.task, self.replicas, self.optimizer, learner.scheduler, learner.scaler)
        self.inputs, self.plan, self.in_place = inputs, inputs.plan, in_place
        self.checkpoints, self.report, self.metrics, self.control = checkpoints, report, report.metrics, control
        self.stop = control.stop
        self.progress = learner.progress
        epochs_steps = config.epochs * self.plan.steps_per_epoch
        self.total_steps = min(epochs_steps, config.max_steps) if config.max_steps else epochs_steps
        self.device = next(self.model.parameters()).device
        self.throughput = Throughput()
        self.stopped_early = self.superseded = False
        self.save_together = self._waiting = False  # every rank's node ends: they save together (stop.verdict)
        self.faults = FaultPoints(env.rank, self.progress.step)
        # Held while the optimizer step and the step counter change: outside it, model, optimizer and
        # step agree, so the peer watch may save them from its own thread while this one is blocked.
        self._state_lock = threading.Lock()
        abort = distributed.abort_data_group if self.device.type == "cuda" else None
        self.failure = FailureHandoff(self._save_last_step, control, Bounds.of(config), self.metrics.warn, abort,
                                      exit=lambda code: agent_link.end_process(code, stopped=self.stop.requested),
                                      unblock=partial(distributed.abandon_round, distributed.this_round())
                                      if in_place else None)

    # -- one step ---------------------------------------------------------------------------------
    def forward_backward(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of global step `step`; leaves the globally averaged gradient in .grad."""
        x, y, idx = self.inputs.batch(step)
        return self.math.forward_backward(x, y), idx

    def _agree(self, loss_sum: torch.Tensor) -> tuple[float, bool]:
        """Global mean loss, and whether the ranks leave (a stop, or the group superseded): one all-reduce
        per step on the control plane, so all ranks decide alike at the same step (stop.verdict)."""
        loss_here = float(loss_sum)  # waits for the device: a stop that comes meanwhile counts at this step
        requested, node_ends, since = self.stop.snapshot()  # one read: a signal may come between any two
        waits = node_ends and self.in_place and not self.checkpoints.saves_alone
        waited = waits and time.monotonic() - since >= self.config.stop_wait
        local = [loss_here, float(requested), float(self.superseded), float(waits), float(waited)]
        loss, stops, superseded, node_ends, waited_out = self.control.agree(local)
        self.superseded = superseded > 0
        verdict = "leave" if self.superseded else stop_verdict(stops, node_ends, waited_out, self.world_size)
        self.save_together = verdict == "save"
        if verdict:
            self.control.ending()
        elif waits and not self._waiting:
            self._waiting = True
            self.metrics.event("stop_waits", step=self.progress.step, wait_s=self.config.stop_wait)
        self.checkpoints.confirm_step()  # every rank finished this step: a state safe to save on failure
        return loss / self.config.global_batch_size, bool(verdict)

    # -- the loop ---------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run to the end (or until a stop is agreed); returns the summary rank 0 writes."""
        start_step = self.progress.step
        self.control.watch(self._on_peer_lost)
        while self.progress.step < self.total_steps:
            t0 = time.perf_counter()
            self.faults.reach("data", self.progress.step)
            loss_sum, idx = self.forward_backward(self.progress.step)
            with self._state_lock:
                self.math.apply()  # optimizer and scheduler: the lr is the scheduler's, a function of the step
                # Counted at once: from here on, model, optimizer and step agree, so a failure in any
                # later collective still leaves a consistent state to save.
                self.progress.step += 1
                self.task.after_step(self.progress.step)
            if self.report.runlog is not None:
                self.report.runlog.step(self.progress.step - 1, self.plan.position(self.progress.step - 1)[0], idx)
            self.faults.reach("control", self.progress.step - 1)
            loss, stop = self._agree(loss_sum)
            self.progress.train_time_s += time.perf_counter() - t0
            self.progress.samples_per_s = self.throughput.rate() or self.progress.samples_per_s
            self._after_step(loss, first=self.progress.step == start_step + 1)
            if stop:
                self._leave()
                break
            self._pace(t0)
        return self._finish()

    def _leave(self) -> None:
        self.stopped_early = True
        why = ("superseded by a newer group" if self.superseded else
               "our torchrun agent died" if self.stop.orphaned else "stop requested")
        self.metrics.event("stop", f"[stop] {why}; leaving at step {self.progress.step}", step=self.progress.step,
                           signalled=self.stop.requested, superseded=self.superseded, orphaned=self.stop.orphaned,
                           saved_together=self.save_together)

    def _after_step(self, loss: float, first: bool) -> None:
        step, cfg = self.progress.step, self.config
        self.throughput.step(cfg.global_batch_size)
        if first:
            self._report_first_step()
        if step % cfg.log_every == 0 or step == self.total_steps:
            self._log_progress(step, self.plan.position(step - 1)[0], loss)
        epoch_end = step % self.plan.steps_per_epoch == 0
        if epoch_end:
            self.evaluate()
        if self.checkpoints.after_step(epoch_end):
            self.superseded = True  # agreed at the next step; a stale group must not write

    def _report_first_step(self) -> None:
        age = process_age_s()
        self.metrics.event("startup", f"[first-step] step {self.progress.step} done {age:.2f}s after process start "
                           f"(world {self.world_size}, restart {self.env.restart_count})", step=self.progress.step,
                           phases={**self.report.startup_marks, "first_step": time.time()})
        self.metrics.scalars(self.progress.step, {"elastic/start_to_first_step_s": age})

    def _log_progress(self, step: int, epoch: int, loss: float) -> None:
        rate = self.throughput.rate() or None  # None in the first steps after a start (the warm-up)
        self.metrics.event(
            "progress", f"[train] epoch {epoch + 1}/{self.config.epochs} step {step}/{self.total_steps} "
            f"loss {loss:.4f} world {self.world_size} restart {self.env.restart_count} "
            f"samples/s {'(warming up)' if rate is None else f'{rate:.0f}'}",
            step=step, epoch=epoch, loss=loss, samples_per_s=rate)
        self.metrics.scalars(step, {
            "train/loss": loss, "train/lr": self.optimizer.param_groups[0]["lr"],
            **({} if rate is None else {"train/samples_per_s": rate}),
            "elastic/world_size": self.world_size, "elastic/restarts": self.env.restart_count})

    def _pace(self, t0: float) -> None:
        remaining = self.config.min_step_time - (time.perf_counter() - t0)
        if remaining > 0:
            time.sleep(remaining)

    # -- evaluation and leaving -------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Test loss/accuracy, each rank scoring its contiguous shard, summed over ranks."""
        self.model.eval()
        totals = torch.zeros(3, device=self.device, dtype=torch.float64)
        for x, y in self._test_batches():
            out = self.model(x)
            totals += torch.stack([self.task.loss(out, y).double(), self.task.correct(out, y).double(),
                                   torch.tensor(float(len(y)), device=self.device, dtype=torch.float64)])
        self.model.train()
        if hasattr(self.model, "reshard"):  # a sharded root unit keeps what its forward gathered (no backward)
            self.model.reshard()
        if self.world_size > 1:
            distributed.wait(dist.all_reduce(totals, async_op=True))
        loss_sum, correct, count = totals.tolist()
        step = self.progress.step
        result = {"step": step, "test_loss": loss_sum / count, "test_accuracy": correct / count}
        self.progress.last_eval = result
        self.metrics.event("eval", f"[eval] step {step} epoch {step / self.plan.steps_per_epoch:.2f} "
                           f"test_loss {result['test_loss']:.4f} test_accuracy {result['test_accuracy']:.4f}",
                           **result, train_time_s=self.progress.train_time_s)
        self.metrics.scalars(step, {"test/loss": result["test_loss"], "test/accuracy": result["test_accuracy"]})
        return result

    def _test_batches(self):
        """This rank's test batches; a sharded model's forward is collective (its units gather their rows), so
        every rank runs as many: empty batches make up the difference."""
        if isinstance(self.replicas, DataParallel) or self.world_size == 1:
            return self.inputs.test_shard()
        batches = list(self.inputs.test_shard())
        most = torch.tensor([len(batches)], dtype=torch.int64, device=self.device)
        distributed.wait(dist.all_reduce(most, op=dist.ReduceOp.MAX, async_op=True))
        x, y = batches[0] if batches else (None, None)
        return batches + [(x[:0], y[:0])] * (int(most[0]) - len(batches))

    # -- a lost peer -------------------------------------------------------------------------------
    def handle_failure(self, error: BaseException) -> Handled | None:
        """Main thread, a collective raised: if a peer is gone, end the round in memory or save the last
        completed step (worker/failure.py); None when the error is not a peer's loss (a bug: the caller re-raises)."""
        if isinstance(error, dist.DistError):
            self.control.alarm()  # ranks whose collectives do not touch the lost peer learn it now
        return self.failure.main_failed(error)

    def _on_peer_lost(self, reason: str) -> None:
        """Peer-watch thread: a peer is gone; the handoff decides who saves (worker/failure.py)."""
        self.metrics.warn(f"peer lost near step {self.progress.step}: {reason}")
        self.metrics.event("peer_lost", step=self.progress.step, reason=reason)
        self.failure.peer_lost()

    def _save_last_step(self, owner: str) -> str:
        """The failure save, on the thread that owns it ("main" or "watch")."""
        if owner == "main":
            self.metrics.event("collective_failed", step=self.progress.step)
        with self._state_lock:  # the main thread may be mid optimizer step when the watch saves
            where = self.checkpoints.save_on_failure()
        if owner == "watch":
            self.metrics.event("saved_by_watch", step=self.progress.step, path=where)
            self.metrics.warn(f"state of step {self.progress.step} saved ({where}); exiting for torchrun to restart")
        return where

    def _finish(self) -> dict:
        if self.progress.last_eval.get("step") != self.progress.step and not self.stopped_early:
            self.evaluate()
        if self.save_together or not (self.in_place and self.stopped_early):  # kept: saved at the node's end
            self.checkpoints.finish(superseded=self.superseded)
        self.control.ending()
        if self.world_size > 1:  # nobody restarts and reads before rank 0's final write is durable, and
            # every rank learns whether a final state went to a snapshot instead (then every snapshot stays)
            unsaved = self.control.agree([1.0 if self.checkpoints.unsaved else 0.0])[0]
            self.checkpoints.unsaved = self.checkpoints.unsaved or ("a peer's final state is in its snapshot"
                                                                    if unsaved else "")
        self.control.leave()
        return self.summary()

    def summary(self) -> dict:
        return {
            "global_step": self.progress.step, "total_steps": self.total_steps,
            "epochs_completed": self.progress.step // self.plan.steps_per_epoch,
            "world_size": self.world_size, "test_accuracy": self.progress.last_eval.get("test_accuracy"),
            "test_loss": self.progress.last_eval.get("test_loss"), "samples_per_s": self.progress.samples_per_s,
            "train_time_s": self.progress.train_time_s, "restarts": self.progress.resumes,
            "torchrun_restart_count": self.env.restart_count, "stopped_early": self.stopped_early,
            "step_ms_median": self.throughput.median_step_ms(), **self.checkpoints.stats(),
        }


def _replicas(config: TrainConfig, model: nn.Module, world_size: int):
    """How the ranks share the gradient: DDP's average, or FSDP2's reduce-scatter into each rank's rows."""
    if config.parallel == "fsdp":
        from elastic_mnist.worker.sharded import ShardedParallel

        return ShardedParallel(model, world_size)
    return DataParallel(model, world_size)
