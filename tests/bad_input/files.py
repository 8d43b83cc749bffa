"""Rows of the bad-input table: files the runtime reads (checkpoints, snapshots, secrets, passwords, TLS
files, etcd's credential files and log) and the directory it caches MNIST beside.

    cd tests && python -m bad_input     # the whole table
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from bad_input.frame import (
    SECRET,
    Attempt,
    Ctx,
    Outcome,
    Row,
    Setup,
    cli,
    fifo,
    file_with,
    place_itself,
    rdzv,
    warned,
    worker_exit,
)
from elastic_mnist.contract.env import CACHE_DIR_ENV, SECRET_FILE_ENV


def _state(step: int) -> dict:
    import torch

    return {"step": step, "weights": torch.arange(64, dtype=torch.float32)}


def _checkpoints(bad: Callable[[Path], None], key: bytes | None = None, written_here: bool = True) -> Setup:
    """A good ckpt-000000005.pt beside a bad ckpt-000000010.pt (made by bad(path)). Not written_here: as
    by another process, so this one knows no state size there and only the memory bounds a read."""
    def setup(place: Path) -> Path:
        from elastic_mnist.state import format as checkpoint

        good, blob = checkpoint.path_for(str(place), 5), checkpoint.encode(_state(5), key)
        checkpoint.write_durable(good, blob) if written_here else Path(good).write_bytes(blob)
        bad(place / "ckpt-000000010.pt")
        return place / "ckpt-000000010.pt"
    return setup


def _restore(key: bytes | None = None) -> Attempt:
    def attempt(target: Path, ctx: Ctx) -> Outcome:
        from elastic_mnist.state import format as checkpoint

        return warned(ctx, lambda warn: checkpoint.load_latest(str(target.parent), warn, key),
                      lambda found: found is not None and found[0]["step"] == 5)
    return attempt


def _sparse(size: int | Callable[[], int]) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        with open(path, "wb") as f:
            f.truncate(size() if callable(size) else size)
    return make


def _huge() -> int:
    from elastic_mnist.state.format import available_memory

    return available_memory() + 1


def _over_growth(path: Path) -> None:
    """One byte over STATE_GROWTH x the good state beside it (which this process wrote: its size is known)."""
    from elastic_mnist.state.format import STATE_GROWTH

    _sparse(STATE_GROWTH * (path.parent / "ckpt-000000005.pt").stat().st_size + 1)(path)


def _snapshot_restore(target: Path, ctx: Ctx) -> Outcome:
    from elastic_mnist.state.sync import best_local

    return warned(ctx, lambda warn: best_local(str(target.parent / "none"), str(target.parent), {"run_id": "r"}, warn),
                  lambda found: found is None)


def _worker_secret(target: Path, ctx: Ctx) -> Outcome:
    from elastic_mnist.job_secret import from_env

    return worker_exit(lambda: from_env({SECRET_FILE_ENV: str(target)}))


CHECKPOINTS = [
    Row("`--checkpoint-dir`", "a FIFO named `ckpt-000000010.pt` beside a good step 5 (no secret)",
        "warning: skipping checkpoint …ckpt-000000010.pt: is a FIFO (named pipe), not a regular file; it is not a "
        "checkpoint this job wrote: move it out of the directory (nothing was read from it)",
        "the FIFO and the good file; step 5 is resumed", "goes on",
        _checkpoints(lambda p: os.mkfifo(p)), _restore()),
    Row("`--checkpoint-dir`", "the same FIFO, in a job with a secret",
        "warning: skipping checkpoint …ckpt-000000010.pt: is a FIFO (named pipe), not a regular file",
        "the FIFO and the good file; step 5 is resumed", "goes on",
        _checkpoints(lambda p: os.mkfifo(p), SECRET), _restore(SECRET)),
    Row("`--checkpoint-dir`", "a sparse `ckpt-000000010.pt` larger than the free memory",
        "warning: skipping checkpoint …ckpt-000000010.pt: is … bytes, over its cap of …; too large to read here "
        "now", "the file and the good one; step 5 is resumed", "goes on",
        _checkpoints(_sparse(_huge), written_here=False), _restore()),
    Row("`--checkpoint-dir`", "a `ckpt-000000010.pt` over 8x the state the job wrote there",
        "warning: skipping checkpoint …ckpt-000000010.pt: is … bytes, over its cap of …",
        "the file and the good one; step 5 is resumed", "goes on",
        _checkpoints(_over_growth), _restore()),
    Row("`--snapshot-dir`", "a FIFO named like a snapshot",
        "warning: skipping checkpoint …ckpt-000000007.pt: is a FIFO (named pipe), not a regular file",
        "the FIFO", "goes on", fifo("ckpt-000000007.pt"), _snapshot_restore),
]

SECRETS = [
    Row("`--rdzv-conf secret_file=`", "`/dev/zero`",
        "the rendezvous secret file (from secret_file) /dev/zero is a character device, not a regular file; give a "
        "regular file holding the key, e.g. `(umask 077; openssl rand -hex 32 > FILE)`",
        "nothing read", "raises EtcdV3ConfigError", place_itself, rdzv(secret_file="/dev/zero")),
    Row("`--rdzv-conf secret_file=`", "a 1 MiB file",
        "the rendezvous secret file (from secret_file) … is 1,048,576 bytes, over its cap of 4,096",
        "the file", "raises EtcdV3ConfigError", file_with("big", b"k" * (1 << 20), 0o600),
        rdzv(secret_file=lambda target: str(target))),
    Row("`$ELASTIC_MNIST_RDZV_SECRET_FILE` (the worker)", "a FIFO",
        "the rendezvous secret file (from $ELASTIC_MNIST_RDZV_SECRET_FILE) … is a FIFO (named pipe), not a "
        "regular file", "the FIFO", "78", fifo("rdzv-secret"), _worker_secret),
    Row("`--rdzv-conf password_file=`", "a FIFO",
        "the etcd password file (from password_file) … is a FIFO (named pipe), not a regular file; give a "
        "regular file holding the password", "the FIFO", "raises EtcdV3ConfigError", fifo("job-password"),
        rdzv(user="elastic-mnist", password_file=lambda target: str(target))),
    Row("`--rdzv-conf password_file=`", "a file that does not exist",
        "cannot read the etcd password file '…/missing' (from password_file): No such file or directory",
        "nothing created", "raises EtcdV3ConfigError", lambda place: place / "missing",
        rdzv(user="elastic-mnist", password_file=lambda target: str(target))),
    Row("`--rdzv-conf cacert=`", "a FIFO",
        "cacert file '…' does not exist or is not a regular file", "the FIFO", "raises EtcdV3ConfigError",
        fifo("ca.pem"), rdzv(protocol="https", cacert=lambda target: str(target))),
]


def _planted(name: str, mode: int = 0o644, owner: int | None = None) -> Setup:
    def setup(place: Path) -> Path:
        path = place / f"etcd.{name}"
        path.write_text("planted\n")
        os.chmod(path, mode)
        if owner is not None:
            os.chown(path, owner, owner)
        return path
    return setup


def _linked(name: str) -> Setup:
    def setup(place: Path) -> Path:
        (place / "elsewhere").write_text("someone's file\n")
        (place / f"etcd.{name}").symlink_to(place / "elsewhere")
        return place / f"etcd.{name}"
    return setup


def _etcd_cli(*flags: str) -> Attempt:
    return lambda target, ctx: cli(ctx, ["etcd", *flags, "--data-dir", str(target.parent / "etcd")])


ETCD = [
    Row("`elastic-mnist etcd --auth --data-dir D`", "`D.job-password` planted with mode 0644",
        "elastic-mnist etcd: error: credential file ….job-password has mode 0644: others may read or change it; "
        "remove it to have a new one generated, or make it yours with mode 0600 (chown, chmod 600)",
        "the planted file; etcd is not started", "2", _planted("job-password"), _etcd_cli("--auth")),
    Row("`elastic-mnist etcd --auth --data-dir D`", "`D.root-password` a symlink to another file",
        "elastic-mnist etcd: error: credential file ….root-password is a symbolic link, which is not followed here",
        "the link and the file it names", "2", _linked("root-password"), _etcd_cli("--auth")),
    Row("`elastic-mnist etcd --auth --data-dir D`", "`D.job-password` mode 0600 of another user (root only)",
        "elastic-mnist etcd: error: credential file ….job-password belongs to uid 65534, not to this user",
        "the planted file", "2", _planted("job-password", 0o600, 65534), _etcd_cli("--auth"), needs="root"),
    Row("`elastic-mnist etcd --data-dir D`", "`D.etcd.log` a symlink to another file",
        "elastic-mnist etcd: error: etcd log file ….etcd.log is a symbolic link, which is not followed here; "
        "remove it, or pass another --data-dir", "the link and the file it names", "2",
        _linked("etcd.log"), _etcd_cli()),
]


def _read_only_data(place: Path) -> Path:
    from elastic_mnist.data.mnist import write_synthetic_mnist

    root = write_synthetic_mnist(place / "data", n_train=100, n_test=20)
    for directory in (root / "MNIST" / "raw", root / "MNIST", root):
        os.chmod(directory, 0o555)
    return root


def _load_beside_read_only(target: Path, ctx: Ctx) -> Outcome:
    from elastic_mnist.data.mnist import load_split

    fallback = target.parent / "xdg"
    ctx.monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    ctx.monkeypatch.setenv("XDG_CACHE_HOME", str(fallback))
    return warned(ctx, lambda warn: load_split(str(target), True),
                  lambda split: len(split.labels) == 100 and len(os.listdir(fallback / "elastic-mnist")) == 1)


CACHE = [
    Row("`--data-dir`", "a read-only (0555) data dir, also as root",
        "none: the decode cache goes to `$XDG_CACHE_HOME/elastic-mnist` instead", "the data dir: no cache in it",
        "goes on", _read_only_data, _load_beside_read_only),
]
