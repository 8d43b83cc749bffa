"""Typed training config: dataclass fields become `elastic-mnist train` flags.

    python -m elastic_mnist.train --help
    python -m elastic_mnist.config > docs/flags.md     # the flag reference, generated

Each field's one-line docstring (the string under it) is its --help text. The fingerprint covers the
fields that make two checkpoints incompatible (model shape, batch size, data set, seed); everything
else (paths, logging, timeouts) may change between restarts.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import os
import sys
from dataclasses import dataclass, field, fields

from elastic_mnist import files
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.env import DATA_DIR_ENV
from elastic_mnist.contract.errors import UserError

# The one env var Kubernetes needs: a pod spec can point every command at a mounted data volume.


# The default in-memory snapshot root: tmpfs, one per user ({uid} is filled in where it is used).
SHM_SNAPSHOTS = "/dev/shm/elastic-mnist-{uid}"


@dataclass
class TrainConfig:
    """One elastic DDP worker training the MLP on MNIST; run it under torchrun (or alone for one process)."""

    data_dir: str = field(default_factory=lambda: os.environ.get(DATA_DIR_ENV, "data"))
    """Root holding MNIST/raw/*-ubyte (torchvision layout); default $ELASTIC_MNIST_DATA_DIR or ./data."""
    download: bool = False
    """Download MNIST into --data-dir with torchvision when it is missing (needs internet)."""
    checkpoint_dir: str = "checkpoints"
    """Directory for checkpoints; shared by all nodes (rank 0 writes, every rank reads)."""
    log_dir: str = "runs"
    """Directory for TensorBoard event files and summary.json (rank 0) and the event journal in events/ (every rank)."""
    epochs: int = 10
    """Number of passes over the training set."""
    max_steps: int = 0
    """Stop after this many global optimizer steps (0: no limit; --epochs decides)."""
    global_batch_size: int = 128
    """Samples per optimizer step over all ranks together; each rank takes its share."""
    lr: float = 1e-3
    """Adam learning rate (the peak, with a schedule)."""
    # hold-cosine on MNIST: >= 98.4% test accuracy after 10 epochs, > 96.5% after 1.
    lr_schedule: str = "hold-cosine"
    """hold-cosine: --lr for half of --epochs, then a cosine decay to 0; cosine: decay throughout; constant: --lr."""
    precision: str = "fp32"
    """fp32; bf16: autocast to bfloat16 (CPU or GPU); fp16: autocast to float16 with a checkpointed GradScaler."""
    grad_clip: float = 0.0
    """Clip the gradient's global norm to this before each optimizer step (fp16: after unscaling; 0: off)."""
    parallel: str = "ddp"
    """ddp: every rank holds the whole model; fsdp: parameters, gradients and optimizer state sharded (fully_shard)."""
    grad_accum: int = 1
    """Micro-batches each rank splits its share of a global step into (the step's samples stay the same)."""
    hidden: int = 512
    """Width of the MLP's hidden layers (784-HIDDEN-10 with one)."""
    hidden_layers: int = 1
    """Hidden layers of the MLP: 3 with --hidden 4096 makes a 37M-parameter model (784-4096-4096-4096-10)."""
    seed: int = 0
    """Seed for the weights and for each epoch's permutation of the data."""
    backend: str = "auto"
    """Process group backend: auto (nccl when every local rank has a GPU, else gloo), gloo or nccl."""
    collective_timeout: float = 60.0
    """Seconds a collective may wait for a dead or frozen peer before the step fails."""
    connect_timeout: float = 15.0
    """Seconds the workers of a round may take to connect to each other; a peer they cannot reach costs this."""
    round_timeout: float = 900.0
    """Seconds a worker kept across rounds waits for its agent's next round before it saves what it holds and exits."""
    peer_timeout: float = 5.0
    """Seconds without a heartbeat after which a frozen peer counts as lost (a killed one is seen at once)."""
    heartbeat_interval: float = 0.25
    """Seconds between peer heartbeats on the control plane."""
    stop_wait: float = 3.0
    """--parallel fsdp: seconds a stopped node trains on to see if all stop (then all save); else it leaves alone."""
    # auto copies on GPUs because they run ahead of the host (see state/manager.py).
    failure_state: str = "auto"
    """Saved on peer loss: copy (last agreed step, on device), live (model as is), auto (GPU: copy; CPU: live)."""
    input: str = "memory"
    """memory: the data set decoded once into tensors (fast); dataloader: a DataLoader with per-sample transforms."""
    num_workers: int = 0
    """DataLoader worker processes with --input dataloader."""
    checkpoint_every: int = 100
    """Save a checkpoint every this many optimizer steps (and at each epoch end); 0 disables periodic saves."""
    keep_checkpoints: int = 3
    """How many of the newest checkpoints to keep."""
    # local: every rank writes to its own node's disk; peers send the state to ranks that lack it.
    checkpoint_storage: str = "shared"
    """shared: one --checkpoint-dir for all (rank 0 writes); local: each node's disk (peers send missing state)."""
    snapshot_every: int = 50
    """Snapshot the training state into --snapshot-dir every this many steps (0: off)."""
    snapshot_dir: str = field(default_factory=lambda: SHM_SNAPSHOTS if os.path.isdir("/dev/shm") else "")
    """Memory that outlives the worker (tmpfs) for in-memory snapshots, private to its user ({uid}); empty: off."""
    snapshot_max_age_h: float = 6.0
    """At start, remove other runs' snapshots in --snapshot-dir not written for this many hours."""
    snapshot_cap_mb: int = 2048
    """At start, remove other runs' snapshots, oldest first, until --snapshot-dir holds at most this (0: no cap)."""
    sample_log: str = ""
    """Directory for per-rank JSONL logs of the dataset indices used at every step (empty: off)."""
    log_every: int = 50
    """Print a progress line every this many steps (rank 0)."""
    min_step_time: float = 0.0
    """Pace training to at least this many seconds per step (demos and fault-injection tests)."""
    startup_cost: float = 0.0
    """Extra seconds at every worker start before the first step: a real job's CUDA context, NCCL init, model load."""

    def validate(self) -> None:
        self._check_finite()
        self._check_ranges()
        self._check_paths()
        if self.lr_schedule not in ("hold-cosine", "cosine", "constant"):
            raise UserError(f"--lr-schedule must be hold-cosine, cosine or constant, got {self.lr_schedule!r}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise UserError(f"--precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise UserError(f"--backend must be auto, gloo or nccl, got {self.backend!r}")
        if self.heartbeat_interval >= self.peer_timeout:
            raise UserError("need 0 < --heartbeat-interval < --peer-timeout")
        if self.failure_state not in ("auto", "copy", "live"):
            raise UserError(f"--failure-state must be auto, copy or live, got {self.failure_state!r}")
        if self.input not in ("memory", "dataloader"):
            raise UserError(f"--input must be memory or dataloader, got {self.input!r}")
        if self.checkpoint_storage not in ("shared", "local"):
            raise UserError(f"--checkpoint-storage must be shared or local, got {self.checkpoint_storage!r}")
        self._check_parallel()

    def _check_parallel(self) -> None:
        if self.parallel not in ("ddp", "fsdp"):
            raise UserError(f"--parallel must be ddp or fsdp, got {self.parallel!r}")
        if self.parallel == "fsdp" and self.checkpoint_storage == "local":
            raise UserError("--parallel fsdp needs --checkpoint-storage shared: every rank of a later round reads "
                            "the rows every rank of this one wrote")
        if self.parallel == "fsdp" and self.precision == "fp16":
            raise UserError("--parallel fsdp trains at --precision fp32 or bf16 (fp16's GradScaler does not take "
                            "sharded gradients): use bf16")

    def _check_finite(self) -> None:
        """Every float flag at once: the range checks below (`<= 0`) let nan and inf through."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{flag_name(f.name)} must be a finite number, got {value}; "
                                f"give a number such as the default {getattr(type(self)(), f.name)!r}")

    def _check_ranges(self) -> None:
        """Every number within RANGES: sizes and durations no run can use are refused here rather than by the
        allocator, a timer or torch's seeding (which overflows past 64 bits)."""
        for name, (low, top) in RANGES.items():
            value, default = getattr(self, name), getattr(type(self)(), name)
            if value > top:
                raise UserError(f"{flag_name(name)} {value} is out of range (at most {top}); give a smaller value, "
                                f"such as the default {default!r}")
            if value < low or (name in POSITIVE and value <= low):
                need = "positive" if name in POSITIVE or low == 1 else f">= {low:g}"
                raise UserError(f"{flag_name(name)} must be {need}, got {value}; give a value such as the default "
                                f"{default!r}")

    def _check_paths(self) -> None:
        """A directory flag whose path runs through a regular file can never be created: say so now."""
        for name in PATH_FIELDS:
            path = getattr(self, name)
            if not path or (name == "snapshot_dir" and "{uid}" in path):
                continue
            blocker = files.file_in_the_way(path)
            if blocker:
                raise UserError(f"{flag_name(name)} {path}: {blocker} is a file, not a directory; pass a directory "
                                "path (it is created if missing)")

    def check_world_size(self, world_size: int) -> None:
        if self.global_batch_size < world_size:
            raise UserError(
                f"--global-batch-size {self.global_batch_size} is smaller than the world size {world_size}: "
                "every rank needs at least one sample per step; raise the batch size or use fewer workers")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fingerprint(self) -> dict:
        """The fields a checkpoint must agree on; paths, logging and timeouts are free to change."""
        return {name: getattr(self, name) for name in FINGERPRINT_FIELDS}

    def job_fingerprint(self) -> dict:
        """The fields every node of a running job must share: a checkpoint's, and how the ranks hold the model
        (DDP and sharded checkpoints are one state; one round's ranks must run the same collectives)."""
        return {**self.fingerprint(), **{name: getattr(self, name) for name in JOB_FIELDS}}

    def to_argv(self) -> list[str]:
        """Flags that rebuild this config through parse_args (the inverse of build_parser): each field
        that differs from its default as --flag=value (booleans as --flag / --no-flag). `=` keeps a
        value that starts with '-' or is empty from being read as the next flag."""
        defaults, argv = type(self)(), []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == getattr(defaults, f.name):
                continue
            if isinstance(value, bool):
                argv.append(flag_name(f.name) if value else flag_name("no_" + f.name))
            else:
                argv.append(f"{flag_name(f.name)}={value}")
        return argv


# The range of every numeric flag, (lowest, highest), both accepted (POSITIVE: above the lowest, 0). Beyond
# these a run would exhaust memory, overflow a timer or never end a step, so the validator names the flag
# instead. The seed feeds torch.manual_seed and each epoch's generator (seed * 1_000_003 + epoch, data/mnist.py),
# which take 64 bits: 32 leave that room. A new int or float field needs an entry (tests/test_config.py checks).
RANGES = {
    "epochs": (1, 100_000), "max_steps": (0, 10**12), "global_batch_size": (1, 1 << 20), "grad_accum": (1, 1 << 16),
    "hidden": (1, 1 << 16), "hidden_layers": (1, 64), "num_workers": (0, 256), "keep_checkpoints": (1, 10_000),
    "checkpoint_every": (0, 10**9),
    "snapshot_every": (0, 10**9), "snapshot_cap_mb": (0, 1 << 30), "snapshot_max_age_h": (0.0, 24 * 365.0),
    "log_every": (1, 10**9), "collective_timeout": (0.0, 86_400.0), "connect_timeout": (0.0, 86_400.0),
    "round_timeout": (0.0, 86_400.0), "peer_timeout": (0.0, 3_600.0), "heartbeat_interval": (0.0, 60.0),
    "stop_wait": (0.0, 20.0),  # with the save, within torchrun's 30 s before it kills its workers
    "min_step_time": (0.0, 3_600.0), "startup_cost": (0.0, 3_600.0), "lr": (0.0, 1_000.0), "grad_clip": (0.0, 1e9),
    "seed": (0, 2**32 - 1),
}
POSITIVE = {"lr", "collective_timeout", "connect_timeout", "round_timeout", "peer_timeout", "heartbeat_interval"}
# (--data-dir and --checkpoint-dir have checks of their own, which tell a node's missing mount from a bad flag.)
PATH_FIELDS = ("log_dir", "snapshot_dir", "sample_log")


def flag_name(field_name: str) -> str:
    """A config field's command-line flag: checkpoint_dir -> --checkpoint-dir."""
    return "--" + field_name.replace("_", "-")


# `dataset` is added by the trainer (training-set size and label hash), so a checkpoint trained on
# another data set is refused too.
FINGERPRINT_FIELDS = ("global_batch_size", "hidden", "hidden_layers", "seed", "lr", "lr_schedule")
# Fingerprint fields added after jobs and checkpoints were made, with the value those were made with: a
# checkpoint's fingerprint, or a running job's, that lacks one agrees with a node that has it at that value.
FINGERPRINT_BEFORE = {"hidden_layers": 1, "parallel": "ddp"}
JOB_FIELDS = ("parallel",)


def with_former_fields(fingerprint: dict) -> dict:
    """A stored fingerprint (a job's, a checkpoint's) with each field newer than it at its former value."""
    return {**FINGERPRINT_BEFORE, **fingerprint}


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field, read from the source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for prev, node in zip(body, body[1:]):
        if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[prev.target.id] = node.value.value
    return docs


class StrictParser(argparse.ArgumentParser):
    """argparse that raises UserError (one line, the worker's exit 78 under torchrun) instead of exiting 2,
    which torchrun would take for a failure worth retrying."""

    def error(self, message: str):
        raise UserError(f"{message}; see `{self.prog} --help`")


def build_parser(cls: type = TrainConfig, prog: str = "elastic-mnist train") -> argparse.ArgumentParser:
    parser = StrictParser(prog=prog, description=(cls.__doc__ or "").strip() or None)
    docs = field_docs(cls)
    defaults = cls()
    for f in fields(cls):
        flag = flag_name(f.name)
        default = getattr(defaults, f.name)
        help_ = f"{docs.get(f.name, '')} (default: {default!r})"
        if isinstance(default, bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_)
        else:
            parser.add_argument(flag, dest=f.name, type=type(default), default=default, help=help_)
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Flags → a validated TrainConfig; bad values exit through argparse or raise UserError."""
    ns = build_parser().parse_args(argv)
    config = TrainConfig(**vars(ns))
    config.validate()
    return config


def flags_markdown(cls: type = TrainConfig) -> str:
    """docs/flags.md: every flag, its default and its field's docstring (regenerate, never edit)."""
    docs, defaults = field_docs(cls), cls()
    lines = ["# `elastic-mnist train` flags", "",
             "<!-- generated by `python -m elastic_mnist.config > docs/flags.md`; do not edit -->", "",
             (cls.__doc__ or "").strip(), "", "| flag | default | meaning |", "|---|---|---|"]
    for f in fields(cls):
        default = getattr(defaults, f.name)
        shown = "`$ELASTIC_MNIST_DATA_DIR` or `data`" if f.name == "data_dir" else f"`{default!r}`"
        lines.append(f"| `{flag_name(f.name)}` | {shown} | {docs.get(f.name, '').replace('|', '/')} |")
    fp = ", ".join(f"`{flag_name(n)}`" for n in FINGERPRINT_FIELDS)
    lines += ["", f"The fingerprint stored in every checkpoint covers {fp} and the data set (size and label hash); "
              "a checkpoint from another fingerprint is refused at resume, and under the `etcd-v3` backend so is a "
              "node whose fingerprint flags differ from those its job trains with (before it joins). "
              "Every other flag may change between restarts."]
    return "\n".join(lines) + "\n"


def given_fields(train_argv: list[str]) -> set[str]:
    """The TrainConfig fields the user set on the command line, however spelled (--x=v, --x v, --no-x):
    argparse itself answers, with every default replaced by a marker no flag can produce."""
    unset = object()  # not argparse.SUPPRESS: argparse would run a string default through the flag's type
    parser = build_parser()
    parser.set_defaults(**{f.name: unset for f in dataclasses.fields(TrainConfig)})
    return {name for name, value in vars(parser.parse_args(train_argv)).items() if value is not unset}


def main(argv: list[str]) -> int:
    """`--check FLAGS...`: exit 0 when the flags are good, else one line and 78; nothing: docs/flags.md."""
    if argv[:1] != ["--check"]:
        print(flags_markdown(), end="")
        return 0
    try:
        parse_args(argv[1:])
    except UserError as e:
        print(f"elastic-mnist train: error: {e}", file=sys.stderr, flush=True)
        return exit_codes.PERMANENT
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
