"""Rank-aware output: every event is a structured record in the run's journal (every rank) and a line on
stdout (rank 0); warnings from any rank; TensorBoard scalars and summary.json from rank 0.

    tensorboard --logdir runs      # reads what Metrics writes
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

from elastic_mnist import procs, volume
from elastic_mnist.contract.env import started_at
from elastic_mnist.contract.errors import UserError
from elastic_mnist.files import atomic_write
from elastic_mnist.runlog import RunLog, say

FINAL_OUTPUTS = ("model.pt", "summary.json")  # what rank 0 replaces in --log-dir when training ends
OUTPUTS_MARK = ".elastic-mnist-outputs"  # written before them: the two files there are this runtime's


def check_log_dir(log_dir: str) -> None:
    """--log-dir may be shared with other runs and tools, but the two files a finished run replaces must be
    this runtime's (marked, or a summary.json it wrote): another program's are never overwritten, so such
    a directory is refused at start, before anything is trained."""
    found = [name for name in FINAL_OUTPUTS if os.path.lexists(os.path.join(log_dir, name))]
    if not found or os.path.isfile(os.path.join(log_dir, OUTPUTS_MARK)) or _our_summary(
            os.path.join(log_dir, "summary.json")):
        return
    raise UserError(f"--log-dir {log_dir} holds {' and '.join(found)} that elastic-mnist did not write (no summary "
                    "of a run of ours beside it), and a finished run would replace them: move them away or pass "
                    "another --log-dir")


def _our_summary(path: str) -> bool:
    try:
        if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) > 1 << 20:
            return False
        with open(path) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and {"global_step", "total_steps", "torchrun_restart_count"} <= set(summary)


def _quiet_event_writer(args) -> None:
    """TensorBoard's event writer thread keeps its error for the next add_scalar (where a full or read-only
    log volume gets its one warning) and also raises it, which would print a traceback: not for those."""
    if type(args.thread).__name__ == "_AsyncWriterThread" and volume.room_error(args.exc_value) is not None:
        return
    _quiet_event_writer.previous(args)


_quiet_event_writer.previous = threading.excepthook


class Metrics:
    def __init__(self, rank: int, log_dir: str, journal: RunLog | None = None):
        self.rank = rank
        self.log_dir = log_dir
        self.journal = journal
        """Where events go as records; readers (the local launcher's view and report) use these fields,
        never the printed text."""
        self._writer = None
        self._tb_enabled = False
        self._resume_step = 0

    def open_tensorboard(self, resume_step: int) -> None:
        """Opened on first use: importing tensorboard (~0.4 s) should not delay the first step."""
        self._resume_step = resume_step
        self._tb_enabled = self.rank == 0

    def _tensorboard(self):
        if self._writer is None and self._tb_enabled:
            from torch.utils.tensorboard import SummaryWriter

            if threading.excepthook is not _quiet_event_writer:
                _quiet_event_writer.previous = threading.excepthook
                threading.excepthook = _quiet_event_writer

            os.makedirs(self.log_dir, exist_ok=True)
            # purge_step drops events past the resume point: that work was lost and is being redone.
            self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=self._resume_step or None)
        return self._writer

    def event(self, kind: str, message: str = "", **fields) -> None:
        """One journal record of `kind` with its fields (and the human line, as `message`); rank 0 also
        prints the line."""
        if self.journal is not None:
            self.journal.event(kind, **({"message": message} if message else {}), **fields)
        if message and self.rank == 0:
            print(message, flush=True)

    def warn(self, msg: str) -> None:
        if self.journal is not None:
            self.journal.event("warning", message=msg)
        say(f"[rank {self.rank}] {msg}")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """TensorBoard scalars (rank 0). On a full or read-only log volume they are skipped, with the volume's
        one warning; a new event file is started once it has room again."""
        if not self._tb_enabled or not volume.of(self.log_dir).ready():
            return
        try:
            writer = self._tensorboard()
            for tag, value in values.items():
                writer.add_scalar(tag, value, step)
        except OSError as e:  # the event writer's thread keeps its first error and raises it at each later call
            self._log_volume_failed("TensorBoard events", e)
            with contextlib.suppress(Exception):
                self._writer.close()
            self._writer, self._resume_step = None, 0  # a new file later, purging nothing
            return
        volume.of(self.log_dir).written(self.warn)

    def _log_volume_failed(self, what: str, error: OSError) -> None:
        """A write into --log-dir failed: the volume's one warning when it is full or read-only, else raised."""
        full = volume.room_error(error)
        if full is None:
            raise error
        volume.of(self.log_dir).failed(f"{what} into {self.log_dir}", full, self.warn)

    def mark_outputs(self) -> None:
        """Before model.pt and summary.json are written: a later start knows they are ours to replace."""
        os.makedirs(self.log_dir, exist_ok=True)
        atomic_write(os.path.join(self.log_dir, OUTPUTS_MARK), "model.pt and summary.json are elastic-mnist's\n")

    def write_summary(self, summary: dict) -> None:
        if self.rank != 0:
            return
        atomic_write(os.path.join(self.log_dir, "summary.json"), json.dumps(summary, indent=2, sort_keys=True) + "\n")

    def write_outputs(self, model_bytes: bytes, summary: dict) -> bool:
        """Rank 0 at the end: model.pt and summary.json into --log-dir (marked first, so a later start knows
        they are ours to replace). False, with the volume's one warning, when the log volume is full or
        read-only (the caller says where the trained state is instead); any other error is raised."""
        try:
            self.mark_outputs()
            atomic_write(os.path.join(self.log_dir, "model.pt"), model_bytes)
            self.write_summary(summary)
        except OSError as e:
            self._log_volume_failed("model.pt and summary.json", e)
            return False
        return True

    def close(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except OSError as e:  # its last records, on a volume that filled up
                self._log_volume_failed("TensorBoard events", e)
            self._writer = None


class Throughput:
    """The one step timer: the trainer and bench's bare and seed loops all measure with it, so their
    ratios compare like with like. Call step() when a step is done; the first `warmup_steps` are left
    out (start-up cost); each measured step is the wall time from the end of the step before, so data
    loading, evaluation and saves in between count."""

    WARMUP_STEPS = 5

    def __init__(self, warmup_steps: int = WARMUP_STEPS):
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.samples = 0
        self.step_s: list[float] = []
        """Wall time of each measured step (end of the step before to end of this one)."""
        self._t0: float | None = None
        self._last = 0.0

    def step(self, samples: int) -> None:
        self.steps += 1
        now = time.perf_counter()
        if self.steps == self.warmup_steps:
            self._t0 = now
        elif self.steps > self.warmup_steps:
            self.samples += samples
            self.step_s.append(now - self._last)
        self._last = now

    def median_step_ms(self) -> float:
        return percentile(self.step_s, 50) * 1000 if self.step_s else 0.0

    def rate(self) -> float:
        """Samples/s over the measured steps, up to the end of the last one."""
        if self._t0 is None or self.samples == 0:
            return 0.0
        return self.samples / max(self._last - self._t0, 1e-9)

    def result(self, **extra) -> dict:
        """What a measured loop prints: rate, median step, measured steps."""
        return {"samples_per_s": self.rate(), "step_ms_median": self.median_step_ms(),
                "steps": len(self.step_s), **extra}


def process_age_s() -> float:
    """Seconds since this process started (kernel start time, so interpreter and import time count).
    The start time is in clock ticks since boot; CLOCK_BOOTTIME is the same clock (btime in /proc/stat
    is rounded to whole seconds and would be off by up to one). A warm child counts from its stand-in's
    exec, where torchrun started this worker (elastic_mnist/warm)."""
    handed = started_at()
    if handed is not None:
        return time.time() - handed
    ticks = procs.start_ticks(os.getpid())
    if ticks is None or not hasattr(time, "CLOCK_BOOTTIME"):
        return float("nan")
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]
