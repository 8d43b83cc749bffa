"""Rows of the bad-input table for the directories a run is pointed at (nothing the runtime did not write is
ever changed, moved or deleted) and for configuration errors (one line, exit 78, nothing started).

    cd tests && python -m bad_input     # the whole table
"""

from __future__ import annotations

import os
from pathlib import Path

from bad_input.frame import Attempt, Ctx, Outcome, Row, cli, place_itself, warned, worker_exit


def _project(place: Path) -> Path:
    """A directory of the user's, as $HOME would be: a project in it, untouched for a month."""
    home = place / "home"
    (home / "old-project").mkdir(parents=True)
    (home / "old-project" / "notes.txt").write_text("mine\n")
    os.chmod(home, 0o755)
    then = 1_000_000_000
    os.utime(home / "old-project", (then, then))
    return home


def _snapshots_into(target: Path, ctx: Ctx) -> Outcome:
    """A worker's snapshots there: refused with one line, training goes on; the start-up sweep removes nothing."""
    from elastic_mnist.metrics import Metrics
    from elastic_mnist.state import snapshots
    from elastic_mnist.state.snapshotter import Snapshotter

    def attempt(_warn):
        place = snapshots.place(str(target), "job", 0, str(target.parent / "ckpt"), enabled=True)
        taker = Snapshotter(str(target), place, None, Metrics(0, ""))
        swept = snapshots.sweep(str(target), keep_run="", max_age_s=0, cap_bytes=1)
        return taker.readable, swept
    return warned(ctx, attempt, lambda found: found == ("", []))


def _foreign_checkpoint(place: Path) -> Path:
    (place / "ckpt").mkdir()
    (place / "ckpt" / "ckpt-000000010.pt").write_bytes(b"another program's file\n")
    return place / "ckpt" / "ckpt-000000010.pt"


def _refuse_checkpoints(storage: str = "shared", itself: bool = False) -> Attempt:
    """The worker's check of its --checkpoint-dir (the target's directory, or the target `itself`)."""
    def attempt(target: Path, ctx: Ctx) -> Outcome:
        from elastic_mnist.config import TrainConfig
        from elastic_mnist.state.manager import check_checkpoint_dir

        where = str(target if itself else target.parent)
        return worker_exit(lambda: check_checkpoint_dir(TrainConfig(checkpoint_dir=where, checkpoint_storage=storage)))
    return attempt


def _foreign_outputs(place: Path) -> Path:
    (place / "runs").mkdir()
    (place / "runs" / "model.pt").write_bytes(b"someone's model\n")
    return place / "runs" / "model.pt"


def _check_log_dir(target: Path, ctx: Ctx) -> Outcome:
    from elastic_mnist.metrics import check_log_dir

    return worker_exit(lambda: check_log_dir(str(target.parent)))


def _etcd_data(place: Path) -> Path:
    (place / "work" / "etcd").mkdir(parents=True)
    (place / "work" / "etcd" / "member").write_text("someone's etcd data\n")
    return place / "work"


def _local(*argv: str, run_dir: bool = True) -> Attempt:
    def attempt(target: Path, ctx: Ctx) -> Outcome:
        where = ["--run-dir", str(target if run_dir else target.parent / "run")]
        return cli(ctx, ["local", *where, *argv])
    return attempt


def _a_file_named(name: str):
    def setup(place: Path) -> Path:
        (place / name).write_text("a file where a directory should be\n")
        return place / name
    return setup


_a_file = _a_file_named("runs")


def _flags(*argv: str | Path) -> Attempt:
    def attempt(target: Path, ctx: Ctx) -> Outcome:
        from elastic_mnist.config import parse_args

        return worker_exit(lambda: parse_args([str(a).replace("TARGET", str(target)) for a in argv]))
    return attempt


def _data(place: Path) -> Path:
    from elastic_mnist.data.mnist import write_synthetic_mnist

    return write_synthetic_mnist(place / "data", n_train=100, n_test=20)


def _batch_over_data(target: Path, ctx: Ctx) -> Outcome:
    from elastic_mnist.data.mnist import BatchPlan, load_split

    return worker_exit(lambda: BatchPlan(len(load_split(str(target), True, cache_dir=target.parent / "c")), 1000, 0))


def _missing_data(target: Path, ctx: Ctx) -> Outcome:
    from elastic_mnist.data.mnist import load_split

    return worker_exit(lambda: load_split(str(target / "nowhere"), True))


DIRS = [
    Row("`--snapshot-dir`", "a directory of the user's (`$HOME`, a project) the runtime did not create",
        "snapshots off on this worker: … already holds files this runtime did not write (1 entries, e.g. "
        "'old-project'); the runtime never changes or sweeps a directory it did not create",
        "its mode (0755), `old-project/` (a month old: never swept)", "goes on", _project, _snapshots_into),
    Row("`--checkpoint-dir`", "another program's file named `ckpt-000000010.pt`",
        "--checkpoint-dir … holds 1 file(s) under names elastic-mnist writes there that it did not write (e.g. "
        "ckpt-000000010.pt); it never moves, replaces or deletes them: move them away, or pass another "
        "--checkpoint-dir",
        "the file, where it was", "78", _foreign_checkpoint, _refuse_checkpoints()),
    Row("`--checkpoint-dir` with `--checkpoint-storage local`", "the same file, on this node's own disk",
        "--checkpoint-dir … holds 1 file(s) under names elastic-mnist writes there that it did not write",
        "the file, where it was; the other nodes train on", "69", _foreign_checkpoint,
        _refuse_checkpoints("local")),
    Row("`--checkpoint-dir`", "a regular file (or a path through one): unusable on this node",
        "checkpoint dir … is not writable on this node (… is a file, not a directory); fix its permissions or "
        "storage class, or pass another --checkpoint-dir", "the file; the other nodes train on", "69",
        _a_file_named("ckpt"), _refuse_checkpoints(itself=True)),
    Row("`--log-dir`", "holds a `model.pt` this package did not write",
        "--log-dir … holds model.pt that elastic-mnist did not write (no summary of a run of ours beside it), "
        "and a finished run would replace them: move them away or pass another --log-dir",
        "the file", "78", _foreign_outputs, _check_log_dir),
    Row("`elastic-mnist local --run-dir`", "a directory holding someone's etcd data",
        "elastic-mnist local: error: --run-dir … already holds files this launcher did not write (1 entries, "
        "e.g. 'etcd'); pass a new or empty directory", "the directory and its files", "78", _etcd_data, _local()),
    Row("`--log-dir`, `--sample-log`", "a path under a regular file",
        "--log-dir …/runs/tb: …/runs is a file, not a directory; pass a directory path (it is created if "
        "missing)", "the file", "78", _a_file, _flags("--log-dir=TARGET/tb")),
    Row("`--hidden`", "`2000000000` (any size or duration past its bound)",
        "--hidden 2000000000 is out of range (at most 65536); give a smaller value, such as the default 512",
        "nothing written", "78", place_itself, _flags("--hidden=2000000000")),
    Row("`--global-batch-size`", "larger than the training set (`1000`, 100 samples)",
        "--global-batch-size 1000 is larger than the training set (100 samples): an epoch would have no step; "
        "pass at most 100", "the data", "78", _data, _batch_over_data),
    Row("`--data-dir`", "no MNIST there (with or without torchvision)",
        "MNIST not found under …/nowhere/MNIST/raw (missing train-images-idx3-ubyte, train-labels-idx1-ubyte). "
        "Point --data-dir (or $ELASTIC_MNIST_DATA_DIR) at a directory holding MNIST/raw/*-ubyte, or add "
        "--download", "nothing written", "78", _data, _missing_data),
    Row("`--epochs`", "`many` (a value of the wrong type, or an unknown flag)",
        "argument --epochs: invalid int value: 'many'; see `elastic-mnist train --help`", "nothing written", "78",
        place_itself, _flags("--epochs=many")),
    Row("`elastic-mnist local --nproc-per-node`", "`0`",
        "elastic-mnist local: error: --nproc-per-node must be 1..64 (workers per node), got 0", "nothing created",
        "78", place_itself, _local("--nproc-per-node", "0", run_dir=False)),
]
