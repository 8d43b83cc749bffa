"""Rows of the bad-input table for inputs that used to get past the checks into training: numbers past what
torch takes, key mismatches on checkpoints, foreign records, data files that are no regular file, and
credential files others may read or change.

    cd tests && python -m bad_input     # the whole table
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

from bad_input.files import _etcd_cli, _planted
from bad_input.frame import Attempt, Ctx, Outcome, Row, Setup, cli, place_itself, rdzv, worker_exit
from elastic_mnist.contract.env import SECRET_FILE_ENV


def _flag(arg: str) -> Attempt:
    def attempt(target: Path, ctx: Ctx) -> Outcome:
        from elastic_mnist.config import parse_args

        return worker_exit(lambda: parse_args([arg]))
    return attempt


def _record(name: str, data: bytes | None) -> Setup:
    """Another program's file under a record's name (None: a FIFO), beside a good checkpoint of ours."""
    def setup(place: Path) -> Path:
        from elastic_mnist.state import format as checkpoint

        checkpoint.write_durable(checkpoint.path_for(str(place), 5), checkpoint.encode({"step": 5}))
        os.mkfifo(place / name) if data is None else (place / name).write_bytes(data)
        return place / name
    return setup


def _refuse_records(target: Path, ctx: Ctx) -> Outcome:
    from elastic_mnist.state.writer import refuse_foreign

    return worker_exit(lambda: refuse_foreign(str(target.parent)))


def _data_file(make) -> Setup:
    """A data set whose decode cache exists, then its images file replaced by make(path)."""
    def setup(place: Path) -> Path:
        from elastic_mnist.data.mnist import load_split, write_synthetic_mnist

        root = write_synthetic_mnist(place / "data", n_train=100, n_test=20)
        load_split(str(root), True, cache_dir=place / "cache")
        path = root / "MNIST" / "raw" / "train-images-idx3-ubyte"
        path.unlink()
        make(path)
        return path
    return setup


def _sparse(size: int, dims: tuple[int, ...] = (100, 28, 28)):
    """An IDX header of `dims`, then nothing: a sparse file of `size` bytes (no disk taken)."""
    def make(path: Path) -> None:
        with open(path, "wb") as f:
            f.write(struct.pack(f">I{len(dims)}I", 0x800 + len(dims), *dims))
            f.truncate(size)
    return make


def _quickly(attempt: Attempt) -> Attempt:
    def timed(target: Path, ctx: Ctx) -> Outcome:
        started = time.monotonic()
        outcome = attempt(target, ctx)
        assert time.monotonic() - started < 10, "refused at once, nothing read or hashed"
        return outcome
    return timed


@_quickly
def _load(target: Path, ctx: Ctx) -> Outcome:
    from elastic_mnist.data.mnist import load_split

    return worker_exit(lambda: load_split(str(target.parents[2]), True, cache_dir=target.parents[3] / "cache"))


@_quickly
def _preflight(target: Path, ctx: Ctx) -> Outcome:
    return cli(ctx, ["preflight", "--rdzv-endpoint=127.0.0.1:1", "--data-dir", str(target.parents[2]),
                     "--checkpoint-dir", str(target.parents[3] / "ckpt")])


def _run_config(place: Path):
    from elastic_mnist.config import TrainConfig

    return TrainConfig(global_batch_size=32, max_steps=30, checkpoint_every=10, hidden=16, log_every=1000,
                       checkpoint_dir=str(place / "ckpt"), log_dir=str(place / "runs"), snapshot_dir="")


def _run_data():
    import torch

    from elastic_mnist.data.mnist import Split

    gen = torch.Generator().manual_seed(0)
    return (Split(torch.randn(320, 784, generator=gen), torch.randint(0, 10, (320,), generator=gen)),
            Split(torch.randn(32, 784, generator=gen), torch.randint(0, 10, (32,), generator=gen)))


def _secret(place: Path, name: str | None) -> str:
    """The path of a secret file named `name` (made once, mode 0600) in place; "" for None (no secret)."""
    if name is None:
        return ""
    path = place / f"secret-{name}"
    if not path.exists():
        path.write_text(name * 32 + "\n")
        path.chmod(0o600)
    return str(path)


def _trained_with(secret: str | None) -> Setup:
    """Steps 10, 20 and 30 saved by a run with the secret `secret` (None: without one)."""
    def setup(place: Path) -> Path:
        from trainers import in_process_trainer


        saved = os.environ.pop(SECRET_FILE_ENV, None)
        try:
            if secret is not None:
                os.environ[SECRET_FILE_ENV] = _secret(place, secret)
            in_process_trainer(_run_config(place), *_run_data()).train()
        finally:
            os.environ.pop(SECRET_FILE_ENV, None)
            if saved is not None:
                os.environ[SECRET_FILE_ENV] = saved
        return place / "ckpt"
    return setup


def _resume_with(secret: str | None) -> Attempt:
    def attempt(target: Path, ctx: Ctx) -> Outcome:
        from trainers import in_process_trainer


        ctx.monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
        if secret is not None:
            ctx.monkeypatch.setenv(SECRET_FILE_ENV, _secret(target.parent, secret))
        return worker_exit(lambda: in_process_trainer(_run_config(target.parent), *_run_data()))
    return attempt


_KEY_LINE = ("--checkpoint-dir …/ckpt holds 3 checkpoint(s) (e.g. ckpt-000000030.pt) {}: the job's secret changed "
             "between runs. To resume, {}; for a new run, pass another directory. Nothing was moved or changed")
_KEPT = "steps 10-30 where they were (no `corrupt/`)"
_HUGE = 200 << 30
_OVER_CAP = (2_000_000, 28, 28)
_FOREIGN_LINE = ("--checkpoint-dir … holds 1 file(s) under names elastic-mnist writes there that it did not write "
                 "(e.g. {}); it never moves, replaces or deletes them: move them away, or pass another "
                 "--checkpoint-dir")

LIMITS = [
    Row("`--checkpoint-dir`, `$ELASTIC_MNIST_RDZV_SECRET_FILE`", "a run with a secret on checkpoints saved without",
        _KEY_LINE.format("written without a job secret, and this run has one", "run without it (drop secret_file "
                         "from --rdzv-conf, unset $ELASTIC_MNIST_RDZV_SECRET_FILE)"), _KEPT, "78",
        _trained_with(None), _resume_with("a")),
    Row("`--checkpoint-dir`, `$ELASTIC_MNIST_RDZV_SECRET_FILE`", "a run without a secret on checkpoints keyed with one",
        _KEY_LINE.format("keyed with a job secret, and this run has none", "run with the job's secret (--rdzv-conf "
                         "secret_file=FILE or $ELASTIC_MNIST_RDZV_SECRET_FILE)"), _KEPT, "78",
        _trained_with("a"), _resume_with(None)),
    Row("`--checkpoint-dir`, `$ELASTIC_MNIST_RDZV_SECRET_FILE`", "a run with another secret than the checkpoints'",
        _KEY_LINE.format("keyed with another job secret than this run's", "run with the secret that wrote them"),
        _KEPT, "78", _trained_with("a"), _resume_with("b")),
    Row("`--seed`", "`100000000000000` (any number past its range: every int and float flag has one)",
        "--seed 100000000000000 is out of range (at most 4294967295); give a smaller value, such as the default 0",
        "nothing written", "78", place_itself, _flag("--seed=100000000000000")),
    Row("`--checkpoint-dir`", "another program's `finished.json` (`{\"done\": true}`)",
        _FOREIGN_LINE.format("finished.json"), "the file and the checkpoint beside it", "78",
        _record("finished.json", b'{"done": true}\n'), _refuse_records),
    Row("`--checkpoint-dir`", "a FIFO named `.generation`", _FOREIGN_LINE.format(".generation"),
        "the FIFO and the checkpoint beside it", "78", _record(".generation", None), _refuse_records),
    Row("`--data-dir` file `train-images-idx3-ubyte`", "a FIFO (a decode cache of the real file beside it)",
        "MNIST file …/train-images-idx3-ubyte is a FIFO (named pipe), not a regular file; re-download MNIST or "
        "point --data-dir at a good copy", "the FIFO and the cache", "78", _data_file(os.mkfifo), _load),
    Row("`--data-dir` file `train-images-idx3-ubyte`", "a sparse 200 GiB file behind a header of 100 images",
        "MNIST file …/train-images-idx3-ubyte cannot be decoded: it is 214748364800 bytes, its header says 78416 "
        "(truncated?); re-download MNIST or point --data-dir at a good copy", "the file and the cache", "78",
        _data_file(_sparse(_HUGE)), _load),
    Row("`--data-dir` file `train-images-idx3-ubyte`", "a sparse file of the size its header promises, 1.5 GB",
        "MNIST file …/train-images-idx3-ubyte is 1,568,000,016 bytes, over the cap of 1,073,741,824 for an MNIST "
        "file; re-download MNIST or point --data-dir at a good copy", "the file and the cache", "78",
        _data_file(_sparse(16 + 2_000_000 * 784, _OVER_CAP)), _load),
    Row("`elastic-mnist preflight --data-dir`", "a FIFO in a file's place",
        "preflight: data: FAILED (permanent, exit 78): MNIST file …/train-images-idx3-ubyte is a FIFO (named "
        "pipe), not a regular file", "the FIFO", "78", _data_file(os.mkfifo), _preflight),
    Row("`elastic-mnist preflight --data-dir`", "a sparse 200 GiB file",
        "preflight: data: FAILED (permanent, exit 78): MNIST file …/train-images-idx3-ubyte cannot be decoded: it "
        "is 214748364800 bytes, its header says 78416", "the file", "78", _data_file(_sparse(_HUGE)), _preflight),
]


def _private(name: str, mode: int, owner: int | None = None) -> Setup:
    """A credential file `name` of `mode` (and `owner`), beside the other TLS files a client key needs."""
    def setup(place: Path) -> Path:
        for other in ("ca.pem", "cert.pem"):
            (place / other).write_text("-----BEGIN CERTIFICATE-----\n")
        (place / name).write_text("s" * 32 + "\n")
        os.chmod(place / name, mode)
        if owner is not None:
            os.chown(place / name, owner, owner)
        return place / name
    return setup


def _worker_secret(target: Path, ctx: Ctx) -> Outcome:
    from elastic_mnist.job_secret import from_env

    return worker_exit(lambda: from_env({SECRET_FILE_ENV: str(target)}))


def _etcd_refused_before_start(target: Path, ctx: Ctx) -> Outcome:
    outcome = _etcd_cli("--auth")(target, ctx)
    made = sorted(p.name for p in target.parent.iterdir() if p.name.startswith("etcd"))
    assert made == ["etcd.rdzv-secret"], f"etcd started or set up something: {made}"
    return outcome


def _path(target: Path) -> str:
    return str(target)


_MODE_FIX = "has mode {:04o}: others may read or change it; make it private: chmod 600 …"
CREDENTIALS = [
    Row("`--rdzv-conf secret_file=`", "a file of mode 0666",
        "the rendezvous secret file (from secret_file) … " + _MODE_FIX.format(0o666), "the file (its mode too)",
        "raises EtcdV3ConfigError", _private("rdzv-secret", 0o666), rdzv(secret_file=_path)),
    Row("`$ELASTIC_MNIST_RDZV_SECRET_FILE` (the worker)", "a file of mode 0644",
        "the rendezvous secret file (from $ELASTIC_MNIST_RDZV_SECRET_FILE) … " + _MODE_FIX.format(0o644),
        "the file", "78", _private("rdzv-secret", 0o644), _worker_secret),
    Row("`--rdzv-conf password_file=`", "a file of mode 0640",
        "the etcd password file (from password_file) … " + _MODE_FIX.format(0o640), "the file",
        "raises EtcdV3ConfigError", _private("job-password", 0o640),
        rdzv(user="elastic-mnist", password_file=_path)),
    Row("`--rdzv-conf password_file=`", "a file of mode 0600 of another user (root only)",
        "the etcd password file (from password_file) … belongs to uid 65534, not to this user (uid 0) or root; make "
        "it this user's and private: chown 0 …; chmod 600 …", "the file", "raises EtcdV3ConfigError",
        _private("job-password", 0o600, 65534), rdzv(user="elastic-mnist", password_file=_path), needs="root"),
    Row("`--rdzv-conf key=`", "a client key of mode 0644",
        "TLS file … " + _MODE_FIX.format(0o644), "the file", "raises EtcdV3ConfigError", _private("key.pem", 0o644),
        rdzv(protocol="https", cacert=lambda t: str(t.parent / "ca.pem"), cert=lambda t: str(t.parent / "cert.pem"),
             key=_path)),
    Row("`elastic-mnist etcd --auth --data-dir D`", "`D.rdzv-secret` planted with mode 0644",
        "elastic-mnist etcd: error: credential file ….rdzv-secret has mode 0644: others may read or change it; "
        "remove it to have a new one generated, or make it yours with mode 0600 (chown, chmod 600)",
        "the planted file; etcd is not started, no password made", "2", _planted("rdzv-secret"),
        _etcd_refused_before_start),
    Row("`elastic-mnist etcd --client-cert-auth --key-file`", "a server key of mode 0644 (its probes present it)",
        "elastic-mnist etcd: error: TLS key file … " + _MODE_FIX.format(0o644), "the file; etcd is not started", "2",
        _private("key.pem", 0o644), lambda target, ctx: _no_etcd(target, _etcd_cli(
            "--cert-file", str(target.parent / "cert.pem"), "--key-file", str(target),
            "--trusted-ca-file", str(target.parent / "ca.pem"), "--client-cert-auth")(target, ctx))),
]


def _no_etcd(target: Path, outcome: Outcome) -> Outcome:
    assert not [p for p in target.parent.iterdir() if p.name.startswith("etcd")], "etcd started"
    return outcome
