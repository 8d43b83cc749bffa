"""The job's secret, shared by every node: the key that seals the rendezvous state and store values (the
etcd-v3 backend) and keys the checkpoint digest (the workers). It is a file named by --rdzv-conf
secret_file=PATH or $ELASTIC_MNIST_RDZV_SECRET_FILE; the backend hands the path on to the workers it
starts, which never see --rdzv-conf.

    ELASTIC_MNIST_RDZV_SECRET_FILE=secret.txt python -c "from elastic_mnist.job_secret import from_env; from_env()"
"""

from __future__ import annotations

import os

from elastic_mnist.contract.env import SECRET_FILE_ENV
from elastic_mnist.contract.errors import UserError
from elastic_mnist.files import RefusedFile, read_regular

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096  # `openssl rand -hex 32` writes 65 bytes: 4 KiB holds any key, and no /dev/zero
SECRET_FIX = "give a regular file holding the key, e.g. `(umask 077; openssl rand -hex 32 > FILE)`"


def read(path: str, source: str) -> bytes:
    """The key in a file (surrounding whitespace, e.g. a trailing newline, is not part of it). A symlink is
    followed (a Kubernetes Secret's keys are symlinks); anything but a regular file is refused unread, and so
    is a file someone else may read or change (files.credential_problem)."""
    try:
        key = read_regular(path, MAX_SECRET_BYTES, f"the rendezvous secret file (from {source})", SECRET_FIX,
                           follow_symlinks=True, credential=True).strip()
    except RefusedFile as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"cannot read the rendezvous secret file {path!r} (from {source}): {exc.strerror}") from None
    if len(key) < MIN_SECRET_BYTES:
        raise UserError(f"the rendezvous secret in {path!r} (from {source}) is {len(key)} bytes; use at least "
                        f"{MIN_SECRET_BYTES} random bytes, e.g. `(umask 077; openssl rand -hex 32 > {path})`")
    return key


def from_env(environ=os.environ) -> bytes | None:
    """The secret named by $ELASTIC_MNIST_RDZV_SECRET_FILE, or None (a job without one)."""
    path = environ.get(SECRET_FILE_ENV)
    return read(path, f"${SECRET_FILE_ENV}") if path else None


def hand_to_workers(secret_file: str | None, environ=os.environ) -> None:
    """In the agent: a secret given as --rdzv-conf secret_file reaches the workers through their environment
    (an explicit $ELASTIC_MNIST_RDZV_SECRET_FILE wins)."""
    if secret_file:
        environ.setdefault(SECRET_FILE_ENV, os.path.abspath(secret_file))
