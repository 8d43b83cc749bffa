"""The training loop: world-size-invariant batches, loss weighting for uneven shares, periodic and
on-demand checkpoints, epoch-end evaluation. Built by elastic_mnist.train; knows nothing of etcd.

    python -m elastic_mnist.train --data-dir ../shared/data --epochs 1
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from elastic_mnist.checkpoint import CheckpointWriter
from elastic_mnist.config import TrainConfig
from elastic_mnist.data import BatchPlan, SampleLog, Split, shard_bounds
from elastic_mnist.metrics import Metrics, Throughput, percentile, process_age_s


class StopRequest:
    """SIGTERM (a spot preemption notice, or torchrun stopping us for a membership change) asks the
    whole group to checkpoint at the next step boundary and leave; a second signal is not caught."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signum = signum
        signal.signal(signum, signal.SIG_DFL)

    @property
    def requested(self) -> bool:
        return self.signum is not None


@dataclass
class Progress:
    """What survives restarts inside the checkpoint besides model and optimizer."""

    step: int = 0
    resumes: int = 0
    train_time_s: float = 0.0
    samples_per_s: float = 0.0
    """Steady-state throughput of the latest (re)start that trained enough steps to measure it."""
    last_eval: dict = field(default_factory=dict)


def cpu_snapshot(obj):
    """Deep copy of tensors to CPU so a background thread can serialize while training mutates them."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_snapshot(v) for v in obj)
    return obj


class Trainer:
    def __init__(self, config: TrainConfig, rank: int, world_size: int, model: nn.Module,
                 optimizer: torch.optim.Optimizer, train: Split, test: Split, metrics: Metrics,
                 progress: Progress, writer: CheckpointWriter | None = None, sample_log: SampleLog | None = None,
                 stop: StopRequest | None = None, restart_count: int = 0, fingerprint: dict | None = None,
                 run_id: str = "local", startup_marks: dict | None = None, fence=None,
                 snapshots: CheckpointWriter | None = None, origin: dict | None = None):
        self.config, self.rank, self.world_size = config, rank, world_size
        self.model = model
        self.ddp = nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
        self.optimizer, self.train_split, self.test_split = optimizer, train, test
        self.metrics, self.progress, self.writer = metrics, progress, writer
        self.sample_log, self.stop = sample_log, stop or StopRequest()
        self.restart_count, self.fingerprint, self.run_id = restart_count, fingerprint or {}, run_id
        self.plan = BatchPlan(len(train), config.global_batch_size, config.seed)
        epochs_steps = config.epochs * self.plan.steps_per_epoch
        self.total_steps = min(epochs_steps, config.max_steps) if config.max_steps else epochs_steps
        self.device = next(model.parameters()).device
        self.throughput = Throughput()
        self.startup_marks = startup_marks or {}
        """Unix times of start-up phases (process start, imports, group, data, resume) for the journal."""
        self.stopped_early = False
        self.fence = fence
        self.snapshots, self.origin = snapshots, origin or {}
        """In-memory snapshots (tmpfs) every --snapshot-every steps; origin tells them from other jobs'."""
        self.snapshot_block_ms: list[float] = []
        """Rank 0's check that this group still owns the checkpoint dir (see checkpoint.claim_generation)."""
        self.superseded = False

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
            if self.sample_log is not None:
                self.sample_log.write(self.progress.step - 1, self.plan.position(self.progress.step - 1)[0], idx)
            loss, stop = self._agree(loss_sum)
            self.progress.train_time_s += time.perf_counter() - t0
            self.progress.samples_per_s = self.throughput.rate() or self.progress.samples_per_s
            self._after_step(loss, first=self.progress.step == start_step + 1)
            if stop:
                self.stopped_early = True
                why = "superseded by a newer group" if self.superseded else "stop requested"
                self.metrics.print0(f"[stop] {why}; leaving at step {self.progress.step}")
                self._journal("stop", step=self.progress.step, signalled=self.stop.requested,
                              superseded=self.superseded)
                break
            self._pace(t0)
        return self._finish()

    def _after_step(self, loss: float, first: bool) -> None:
        step, plan, cfg = self.progress.step, self.plan, self.config
        epoch, _ = plan.position(step - 1)
        self.throughput.step(cfg.global_batch_size)
        if first:
            self._report_first_step()
        if step % cfg.log_every == 0 or step == self.total_steps:
            self._log_progress(step, epoch, loss)
        epoch_end = step % plan.steps_per_epoch == 0
        if epoch_end:
            self.evaluate()
        checkpoint_due = epoch_end or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
        if self.snapshots is not None and step % cfg.snapshot_every == 0 and not checkpoint_due:
            t0 = time.perf_counter()  # a checkpoint of the same step would make the snapshot redundant
            self.snapshots.save(self.state(), step)
            self.snapshot_block_ms.append((time.perf_counter() - t0) * 1000)
        if self.writer is not None and checkpoint_due:
            if self.fence is not None and not self.fence():
                self.superseded = True  # agreed at the next step; a stale group must not write
                self.metrics.warn(f"a newer group owns {cfg.checkpoint_dir}; this one stops to rejoin it")
            else:
                self.save()

    def _journal(self, kind: str, **fields) -> None:
        if self.sample_log is not None:
            self.sample_log.event(kind, **fields)

    def _report_first_step(self) -> None:
        age = process_age_s()
        self._journal("startup", step=self.progress.step, phases={**self.startup_marks, "first_step": time.time()})
        self.metrics.print0(f"[first-step] step {self.progress.step} done {age:.2f}s after process start "
                            f"(world {self.world_size}, restart {self.restart_count})")
        self.metrics.scalars(self.progress.step, {"elastic/start_to_first_step_s": age})

    def _log_progress(self, step: int, epoch: int, loss: float) -> None:
        rate = self.throughput.rate()
        self.metrics.print0(
            f"[train] epoch {epoch + 1}/{self.config.epochs} step {step}/{self.total_steps} loss {loss:.4f} "
            f"world {self.world_size} restart {self.restart_count} samples/s {rate:.0f}")
        self.metrics.scalars(step, {
            "train/loss": loss, "train/lr": self.optimizer.param_groups[0]["lr"], "train/samples_per_s": rate,
            "elastic/world_size": self.world_size, "elastic/restarts": self.restart_count})

    def _pace(self, t0: float) -> None:
        remaining = self.config.min_step_time - (time.perf_counter() - t0)
        if remaining > 0:
            time.sleep(remaining)

    # -- evaluation and checkpoints -------------------------------------------------------------------
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

    def state(self) -> dict:
        epoch, position = self.plan.position(self.progress.step)
        return cpu_snapshot({
            "step": self.progress.step, "epoch": epoch, "position": position,
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
            "config": self.config.to_dict(), "fingerprint": self.fingerprint, "world_size": self.world_size,
            "run_id": self.run_id, "origin": self.origin, "saved_at": time.time(),
            "progress": {"resumes": self.progress.resumes, "train_time_s": self.progress.train_time_s,
                         "samples_per_s": self.progress.samples_per_s, "last_eval": self.progress.last_eval},
        })

    def save(self, block: bool = False) -> None:
        """Rank 0 snapshots and hands the write to a thread; only the snapshot blocks training."""
        if self.writer is None:
            return
        t0 = time.perf_counter()
        self.writer.save(self.state(), self.progress.step, block=block)
        if not block:  # a blocking save happens only when leaving, not while training
            block_ms = (time.perf_counter() - t0) * 1000
            self.writer.block_ms.append(block_ms)
            self.metrics.scalars(self.progress.step, {"checkpoint/block_ms": block_ms})

    def save_on_failure(self) -> str:
        """A peer died mid-step: this rank still holds the state of its last completed step, so any
        survivor may persist it. The no-overwrite rename makes the first survivor's copy win."""
        if self.writer is not None:
            try:
                self.writer.wait()
            except RuntimeError as e:
                self.metrics.warn(f"in-flight checkpoint write failed: {e}")
        self._journal("collective_failed", step=self.progress.step)
        writer = CheckpointWriter(self.config.checkpoint_dir, self.config.keep_checkpoints)
        writer.save(self.state(), self.progress.step, block=True)
        return writer.last_path or "already saved by another survivor"

    def _finish(self) -> dict:
        if self.progress.last_eval.get("step") != self.progress.step and not self.stopped_early:
            self.evaluate()
        if not self.superseded:
            self.save(block=True)
        elif self.writer is not None:
            self.writer.wait()  # an earlier save still in flight is ours to finish
        if self.world_size > 1:
            dist.barrier()  # nobody restarts and reads before rank 0's final write is durable
        return self.summary()

    def summary(self) -> dict:
        block = self.writer.block_ms if self.writer else []
        return {
            "global_step": self.progress.step, "total_steps": self.total_steps,
            "epochs_completed": self.progress.step // self.plan.steps_per_epoch,
            "world_size": self.world_size, "test_accuracy": self.progress.last_eval.get("test_accuracy"),
            "test_loss": self.progress.last_eval.get("test_loss"), "samples_per_s": self.progress.samples_per_s,
            "train_time_s": self.progress.train_time_s, "restarts": self.progress.resumes,
            "torchrun_restart_count": self.restart_count, "stopped_early": self.stopped_early,
            "checkpoints_saved": self.writer.saved if self.writer else 0,
            "checkpoint_block_ms_mean": sum(block) / len(block) if block else 0.0,
            "checkpoint_block_ms_p50": percentile(block, 50), "checkpoint_block_ms_p95": percentile(block, 95),
            "checkpoint_block_ms_max": max(block) if block else 0.0,
            "step_ms_median": self.throughput.median_step_ms(),
            "snapshots_taken": len(self.snapshot_block_ms),
            "snapshot_block_ms_p50": percentile(self.snapshot_block_ms, 50),
        }
