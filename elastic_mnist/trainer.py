"""The training loop: world-size-invariant batches, loss weighting for uneven shares, the per-step
agreement, epoch-end evaluation. Built by elastic_mnist.train; knows nothing of etcd, and asks the
checkpoint manager (checkpoints.py) what to save instead of assembling checkpoints itself.

    python -m elastic_mnist.train --data-dir ../shared/data --epochs 1
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from elastic_mnist.checkpoints import CheckpointManager
from elastic_mnist.config import TrainConfig
from elastic_mnist.data import BatchPlan, Split, shard_bounds
from elastic_mnist.distributed import DistEnv
from elastic_mnist.metrics import Metrics, Throughput, process_age_s
from elastic_mnist.runlog import RunLog

EXIT_UNSUPERVISED = 70  # the agent died and the group could not agree on a stop in time


class StopRequest:
    """SIGTERM (a spot preemption notice, or torchrun stopping us for a membership change) or SIGHUP
    (our torchrun agent died: the parent-death signal) asks the whole group to checkpoint at the next
    step boundary and leave; a second signal of the same kind is not caught.

    Without an agent nobody supervises this worker, so after `orphan_grace_s` it exits however far the
    agreement got: a worker never trains on alone."""

    def __init__(self, orphan_grace_s: float = 0.0) -> None:
        self.signum: int | None = None
        self.orphan_grace_s = orphan_grace_s

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        if signum == signal.SIGHUP and self.orphaned:
            return  # the kernel may deliver the parent-death signal more than once; the timer bounds us
        self.signum = signum
        if signum != signal.SIGHUP:
            signal.signal(signum, signal.SIG_DFL)
        elif self.orphan_grace_s:
            timer = threading.Timer(self.orphan_grace_s, os._exit, args=(EXIT_UNSUPERVISED,))
            timer.daemon = True
            timer.start()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def orphaned(self) -> bool:
        return self.signum == signal.SIGHUP


@dataclass
class Reporting:
    """Where a trainer reports: rank-0 output and TensorBoard, the run log, start-up phase times."""

    metrics: Metrics
    runlog: RunLog | None = None
    startup_marks: dict = field(default_factory=dict)
    """Unix times of start-up phases (process start, imports, group, data, resume) for the journal."""


class Trainer:
    def __init__(self, config: TrainConfig, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer,
                 data: tuple[Split, Split], checkpoints: CheckpointManager, report: Reporting,
                 stop: StopRequest | None = None):
        self.config, self.env, self.rank, self.world_size = config, env, env.rank, env.world_size
        self.model = model
        self.ddp = nn.parallel.DistributedDataParallel(model) if env.world_size > 1 else model
        self.optimizer, (self.train_split, self.test_split) = optimizer, data
        self.checkpoints, self.report, self.metrics = checkpoints, report, report.metrics
        self.stop = stop or StopRequest()
        self.plan = BatchPlan(len(self.train_split), config.global_batch_size, config.seed)
        checkpoints.attach(model, optimizer, self.plan.steps_per_epoch)
        self.progress = checkpoints.progress
        epochs_steps = config.epochs * self.plan.steps_per_epoch
        self.total_steps = min(epochs_steps, config.max_steps) if config.max_steps else epochs_steps
        self.device = next(model.parameters()).device
        self.throughput = Throughput()
        self.stopped_early = self.superseded = False

    # -- one step ---------------------------------------------------------------------------------
    def forward_backward(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of global step `step`; leaves the globally averaged gradient in .grad."""
        idx = self.plan.rank_indices(step, self.world_size, self.rank)
        dev_idx = idx.to(self.device, non_blocking=True)
        x, y = self.train_split.images[dev_idx], self.train_split.labels[dev_idx]
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = F.nll_loss(self.ddp(x), y, reduction="sum")
        # DDP averages gradients over ranks; scaling by world/B makes that average the mean over the
        # whole global batch however unevenly it was split.
        (loss_sum * (self.world_size / self.config.global_batch_size)).backward()
        return loss_sum.detach(), idx

    def _agree(self, loss_sum: torch.Tensor) -> tuple[float, bool]:
        """Global mean loss, and whether any rank was asked to stop (or found the group superseded):
        one all-reduce per step, so all ranks decide alike at the same step."""
        flags = torch.tensor([float(self.stop.requested), float(self.superseded)], device=self.device)
        packed = torch.cat([loss_sum.float().reshape(1), flags])
        if self.world_size > 1:
            dist.all_reduce(packed)
        loss, stop, superseded = packed.tolist()
        self.superseded = superseded > 0
        return loss / self.config.global_batch_size, stop > 0 or self.superseded

    # -- the loop ---------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run to the end (or until a stop is agreed); returns the summary rank 0 writes."""
        start_step = self.progress.step
        while self.progress.step < self.total_steps:
            t0 = time.perf_counter()
            loss_sum, idx = self.forward_backward(self.progress.step)
            self.optimizer.step()
            # Counted at once: from here on, model, optimizer and step agree, so a failure in any later
            # collective still leaves a consistent state to save (save_on_failure).
            self.progress.step += 1
            if self.report.runlog is not None:
                self.report.runlog.step(self.progress.step - 1, self.plan.position(self.progress.step - 1)[0], idx)
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
        self.metrics.print0(f"[stop] {why}; leaving at step {self.progress.step}")
        self._journal("stop", step=self.progress.step, signalled=self.stop.requested, superseded=self.superseded,
                      orphaned=self.stop.orphaned)

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

    def _journal(self, kind: str, **fields) -> None:
        if self.report.runlog is not None:
            self.report.runlog.event(kind, **fields)

    def _report_first_step(self) -> None:
        age = process_age_s()
        self._journal("startup", step=self.progress.step,
                      phases={**self.report.startup_marks, "first_step": time.time()})
        self.metrics.print0(f"[first-step] step {self.progress.step} done {age:.2f}s after process start "
                            f"(world {self.world_size}, restart {self.env.restart_count})")
        self.metrics.scalars(self.progress.step, {"elastic/start_to_first_step_s": age})

    def _log_progress(self, step: int, epoch: int, loss: float) -> None:
        rate = self.throughput.rate()
        self.metrics.print0(
            f"[train] epoch {epoch + 1}/{self.config.epochs} step {step}/{self.total_steps} loss {loss:.4f} "
            f"world {self.world_size} restart {self.env.restart_count} samples/s {rate:.0f}")
        self.metrics.scalars(step, {
            "train/loss": loss, "train/lr": self.optimizer.param_groups[0]["lr"], "train/samples_per_s": rate,
            "elastic/world_size": self.world_size, "elastic/restarts": self.env.restart_count})

    def _pace(self, t0: float) -> None:
        remaining = self.config.min_step_time - (time.perf_counter() - t0)
        if remaining > 0:
            time.sleep(remaining)

    # -- evaluation and leaving -------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Test loss/accuracy, each rank scoring its contiguous shard, summed over ranks."""
        start, end = shard_bounds(len(self.test_split), self.world_size, self.rank)
        x, y = self.test_split.images[start:end], self.test_split.labels[start:end]
        self.model.eval()
        out = self.model(x)
        self.model.train()
        totals = torch.stack([F.nll_loss(out, y, reduction="sum"), (out.argmax(1) == y).sum().float(),
                              torch.tensor(float(len(y)), device=self.device)])
        if self.world_size > 1:
            dist.all_reduce(totals)
        loss_sum, correct, count = totals.tolist()
        step = self.progress.step
        result = {"step": step, "test_loss": loss_sum / count, "test_accuracy": correct / count}
        self.progress.last_eval = result
        self._journal("eval", **result, train_time_s=self.progress.train_time_s)
        self.metrics.print0(f"[eval] step {step} epoch {step / self.plan.steps_per_epoch:.2f} "
                            f"test_loss {result['test_loss']:.4f} test_accuracy {result['test_accuracy']:.4f}")
        self.metrics.scalars(step, {"test/loss": result["test_loss"], "test/accuracy": result["test_accuracy"]})
        return result

    def save_on_failure(self) -> str:
        """A peer died mid-step: persist the state of this rank's last completed step."""
        self._journal("collective_failed", step=self.progress.step)
        return self.checkpoints.save_on_failure()

    def _finish(self) -> dict:
        if self.progress.last_eval.get("step") != self.progress.step and not self.stopped_early:
            self.evaluate()
        self.checkpoints.finish(superseded=self.superseded)
        if self.world_size > 1:
            dist.barrier()  # nobody restarts and reads before rank 0's final write is durable
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
