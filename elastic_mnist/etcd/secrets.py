"""Where the etcd-v3 backend's secrets come from: files and environment variables, never a command line.

    ELASTIC_MNIST_ETCD_USER=elastic-mnist ELASTIC_MNIST_ETCD_PASSWORD_FILE=/etc/elastic-mnist/etcd/job-password \\
    ELASTIC_MNIST_RDZV_SECRET_FILE=/etc/elastic-mnist/etcd/rdzv-secret torchrun --rdzv-backend=etcd-v3 ...

--rdzv-conf user=NAME,password_file=PATH,secret_file=PATH say the same and win over the environment.
A command line is readable by every local user (`ps`, /proc/PID/cmdline) and torchrun logs its
--rdzv-conf at LOGLEVEL=INFO; torch also splits --rdzv-conf on commas, so a password with a comma
could not be passed there at all.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from elastic_mnist import job_secret
from elastic_mnist.contract.env import PASSWORD_FILE_ENV, SECRET_FILE_ENV, USER_ENV
from elastic_mnist.contract.errors import UserError
from elastic_mnist.contract.rdzv_conf import EtcdV3ConfigError, value_of
from elastic_mnist.etcd.client import EtcdConnectionSpec, EtcdV3Error
from elastic_mnist.files import RefusedFile, read_regular

_warned_password = False
MAX_PASSWORD_BYTES = 4096  # etcd hashes passwords with bcrypt, which reads 72 bytes: 4 KiB holds any of them


def credentials(user: str | None, password: str | None, password_file: str | None,
                environ: dict[str, str] | os._Environ[str] = os.environ) -> tuple[str | None, str | None]:
    """(user, password) from --rdzv-conf user/password_file/password, else from $ELASTIC_MNIST_ETCD_USER
    and $ELASTIC_MNIST_ETCD_PASSWORD_FILE. `password=` still works, with one warning per process."""
    global _warned_password
    if password and password_file:
        raise EtcdV3Error("give the etcd password as password_file=PATH or password=SECRET, not both")
    if password and not _warned_password:
        _warned_password = True
        print("elastic-mnist: warning: password= in --rdzv-conf is visible to every local user (ps, "
              f"/proc/PID/cmdline) and in torchrun's log; use password_file=PATH or ${PASSWORD_FILE_ENV}",
              file=sys.stderr, flush=True)
    user = user or environ.get(USER_ENV) or None
    if not password and password_file:
        password = read_password(password_file, "password_file")
    elif not password and environ.get(PASSWORD_FILE_ENV):
        password = read_password(environ[PASSWORD_FILE_ENV], f"${PASSWORD_FILE_ENV}")
    return user, password


def read_password(path: str, source: str = "--password-file") -> str:
    """A password file's text without its trailing newline (`echo pw > file` adds one). A symlink is followed
    (a Kubernetes Secret's keys are symlinks); anything but a regular file is refused unread, and so is a file
    someone else may read or change (files.credential_problem)."""
    try:
        password = read_regular(path, MAX_PASSWORD_BYTES, f"the etcd password file (from {source})",
                                "give a regular file holding the password", follow_symlinks=True,
                                credential=True).decode()
        password = password.rstrip("\r\n")
    except RefusedFile as exc:
        raise EtcdV3Error(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise EtcdV3Error(f"cannot read the etcd password file {path!r} (from {source}): "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    if not password:
        raise EtcdV3Error(f"the etcd password file {path!r} (from {source}) is empty")
    return password


def secret(secret_file: str | None, environ: dict[str, str] | os._Environ[str] = os.environ) -> bytes | None:
    """The job's state HMAC key: secret_file=PATH, else $ELASTIC_MNIST_RDZV_SECRET_FILE, else None (off)."""
    if secret_file:
        return read_secret(secret_file, "secret_file")
    return read_secret(environ[SECRET_FILE_ENV], f"${SECRET_FILE_ENV}") if environ.get(SECRET_FILE_ENV) else None


def read_secret(path: str, source: str) -> bytes:
    """The HMAC key in a file (job_secret.read), as this package's connection error."""
    try:
        return job_secret.read(path, source)
    except UserError as exc:
        raise EtcdV3Error(str(exc)) from None


def connection_spec(endpoint: str, conf: Mapping[str, Any]) -> EtcdConnectionSpec:
    """How to reach etcd from conf's connection keys (the rest are ignored). user and password_file fall
    back to the environment; password= works with one warning (credentials)."""
    read_timeout = value_of("read_timeout", conf.get("read_timeout"))
    outage = value_of("outage_timeout", conf.get("outage_timeout"))
    try:
        user, password = credentials(conf.get("user"), conf.get("password"), conf.get("password_file"))
        return EtcdConnectionSpec.parse(endpoint, conf.get("protocol"), read_timeout, user=user, password=password,
                                        **{k: conf.get(k) for k in ("cacert", "cert", "key")},
                                        **({} if outage is None else {"outage_timeout": outage}))
    except EtcdV3Error as exc:
        raise EtcdV3ConfigError(str(exc)) from exc
