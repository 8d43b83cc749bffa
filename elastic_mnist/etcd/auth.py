"""`elastic-mnist etcd-auth`: least-privilege authentication on an etcd you run yourself (Kubernetes).

    elastic-mnist etcd-auth --endpoint 127.0.0.1:2379 --root-password-file /etc/elastic-mnist/etcd/root-password \\
        --password-file /etc/elastic-mnist/etcd/job-password [--wait 300] [--recheck 30 --ready-file /tmp/ready]

Makes etcd converge on: root with the given password, user `elastic-mnist` (--user) allowed to read
and write only the --prefix keys (default /torchelastic/), authentication enabled (see
etcd/admin.py). Passwords come from files only, never from the command line. Idempotent: run it
on every start. It retries until --wait seconds pass (etcd may still be starting or electing a leader);
with --recheck it stays running, re-applying every RECHECK seconds and keeping --ready-file present
only while the last check passed (the etcd pod's readiness, so trainers never reach an etcd without auth).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from elastic_mnist.contract.errors import UserError

RETRY_S = 1.0  # between attempts while etcd starts; each attempt is bounded by --read-timeout


def _parse(argv: list[str]) -> argparse.Namespace:
    from elastic_mnist.etcd.admin import JOB_PREFIXES, JOB_USER

    p = argparse.ArgumentParser(prog="elastic-mnist etcd-auth", description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", default="127.0.0.1:2379", help="etcd host:port (default 127.0.0.1:2379)")
    p.add_argument("--protocol", choices=["http", "https"], help="default: http, or the endpoint's scheme")
    p.add_argument("--cacert", help="CA of etcd's server certificate (https)")
    p.add_argument("--cert", help="client certificate, when etcd runs with --client-cert-auth")
    p.add_argument("--key", help="the private key of --cert")
    p.add_argument("--root-password-file", required=True, help="root's password (kept by the operator)")
    p.add_argument("--user", default=JOB_USER, help=f"the job's etcd user (default {JOB_USER})")
    p.add_argument("--password-file", required=True, help="the job user's password")
    p.add_argument("--prefix", action="append", help=f"key prefix the job may use; repeatable (default "
                                                     f"{' '.join(JOB_PREFIXES)})")
    p.add_argument("--read-timeout", type=float, default=5.0, help="deadline of each etcd call, seconds")
    p.add_argument("--wait", type=float, default=300.0, help="keep trying this long for etcd to come up")
    p.add_argument("--recheck", type=float, default=0.0, help="stay running, re-applying every RECHECK seconds")
    p.add_argument("--ready-file", help="present while authentication is known to be in place")
    args = p.parse_args(argv)
    args.prefix = args.prefix or list(JOB_PREFIXES)
    return args


def _ensure_once(args: argparse.Namespace) -> None:
    from elastic_mnist.etcd.admin import JobAccount, ensure_auth
    from elastic_mnist.etcd.client import EtcdConnectionSpec
    from elastic_mnist.etcd.secrets import read_password

    spec = EtcdConnectionSpec.parse(args.endpoint, args.protocol, args.read_timeout, cacert=args.cacert,
                                    cert=args.cert, key=args.key)
    job = JobAccount(args.user, read_password(args.password_file), tuple(args.prefix))
    ensure_auth(spec, read_password(args.root_password_file), job)


def _ensure(args: argparse.Namespace, stop: threading.Event, seconds: float) -> bool:
    """Retry until it holds, `seconds` pass or we are stopped; each distinct error is printed once."""
    deadline, seen = time.monotonic() + seconds, set()
    while True:
        try:
            _ensure_once(args)
            return True
        except UserError as exc:
            if str(exc) not in seen:
                seen.add(str(exc))
                print(f"elastic-mnist etcd-auth: not yet: {exc}", file=sys.stderr, flush=True)
            if time.monotonic() + RETRY_S > deadline:
                raise
        if stop.wait(RETRY_S):  # a retry backoff while etcd starts, interruptible by SIGTERM
            return False


def _mark_ready(path: str | None, ready: bool) -> None:
    if path:
        Path(path).touch() if ready else Path(path).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    _mark_ready(args.ready_file, False)
    if not _ensure(args, stop, args.wait):
        return 0
    _mark_ready(args.ready_file, True)
    print(f"etcd at {args.endpoint}: authentication on; {args.user!r} may use only "
          f"{', '.join(args.prefix)}", flush=True)
    while args.recheck > 0 and not stop.wait(args.recheck):
        try:
            _ensure(args, stop, args.recheck)
            _mark_ready(args.ready_file, True)
        except UserError as exc:
            _mark_ready(args.ready_file, False)
            print(f"elastic-mnist etcd-auth: error: {exc}", file=sys.stderr, flush=True)
    _mark_ready(args.ready_file, False)
    return 0
