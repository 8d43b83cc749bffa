"""`elastic-mnist preflight`: what no restart can fix, checked before torchrun touches the rendezvous.

    elastic-mnist preflight --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --data-dir data --checkpoint-dir ckpt
    elastic-mnist preflight --nnodes=1:4 --rdzv-backend=etcd ... -m elastic_mnist.train --data-dir /data/mnist ...

The second form takes a pod's torchrun arguments word for word (the Kubernetes init container does).
One line per check. Exit 0: all good, or the job already finished (nothing to do). Exit 78
(PERMANENT): retrying cannot help on any node: fix the configuration (flags, --rdzv-conf, MNIST on
the shared volume, etcd's API), or (rendezvous closed before the job finished) start a new Job; the
Job's podFailurePolicy fails the Job on it. Exit 69 (NODE_LOCAL): this node lacks something another
node may have (no CUDA device for nccl, the checkpoint dir not writable from here, no usable
/dev/shm, a GPU driver too old for the image's CUDA, a GPU that fails, hangs in or miscomputes a test
matmul); the podFailurePolicy fails this pod's index only, and with $ELASTIC_MNIST_NODE_LOCAL_HOLD_S set
the exit waits that long, so that the start watchdog can mark the node before a replacement could land
there. Exit 75 (TRANSIENT): etcd still unreachable after --wait
seconds (600: longer than the rendezvous backend rides out an outage) of retrying with backoff.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from elastic_mnist.config import parse_args
from elastic_mnist.contract.env import NODE_LOCAL_HOLD_ENV
from elastic_mnist.contract.errors import UserError
from elastic_mnist.contract.exit_codes import NODE_LOCAL, OK, PERMANENT, TRANSIENT, killed_by
from elastic_mnist.contract.rdzv_conf import CONNECTION_KEYS, SCHEMA, parse_conf
from elastic_mnist.ops.nodecheck import NodeLocal, check_device, check_shm, kernel_hung

__all__ = ["NODE_LOCAL", "PERMANENT", "SCHEMA", "TRANSIENT", "Launch",
           "closed_line", "finished_line", "main", "parse_launch",
           "run_checks"]
BACKENDS = ("etcd-v3", "etcd")
# What preflight reads from --rdzv-conf: how to reach etcd, and the secret the state is sealed with.
CONN_KEYS = (*CONNECTION_KEYS, "secret_file")


class Permanent(Exception):
    """A check failed in a way no retry fixes; the message names the cause and the fix."""


class Transient(Exception):
    """A check failed in a way that may heal by itself (etcd not up yet)."""


@dataclass
class Launch:
    """What preflight and `elastic-mnist pod` need from a torchrun-style command line."""

    backend: str
    endpoint: str
    run_id: str
    conn: dict
    key_prefix: str | None
    max_nodes: int
    train_args: list[str]
    wait_s: float


def parse_launch(argv: list[str]) -> Launch:
    """torchrun flags [-m MODULE train flags], or rendezvous flags mixed with train flags."""
    p = argparse.ArgumentParser(prog="elastic-mnist preflight", add_help=True)
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="etcd-v3")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="127.0.0.1:2379")
    p.add_argument("--rdzv-id", "--rdzv_id", default="")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="")
    p.add_argument("--nnodes", default="1:4")
    p.add_argument("--wait", type=float, default=600.0, help="seconds to keep retrying an unreachable etcd")
    launcher, train = (argv[:argv.index("-m")], argv[argv.index("-m") + 2:]) if "-m" in argv else (argv, None)
    ns, rest = p.parse_known_args(launcher)
    if ns.rdzv_backend not in BACKENDS:
        raise UserError(f"--rdzv-backend {ns.rdzv_backend!r} is not one of {', '.join(BACKENDS)}")
    # etcd-v3's keys are checked as its backend will (contract/rdzv_conf.py); torch's legacy `etcd` backend has keys of
    # its own and ignores unknown ones, so for it only the connection keys are picked out.
    conf = parse_conf(ns.rdzv_conf) if ns.rdzv_backend == "etcd-v3" else \
        dict(item.partition("=")[::2] for item in ns.rdzv_conf.split(",") if item)
    conn = {k: v for k, v in conf.items() if k in CONN_KEYS}
    return Launch(ns.rdzv_backend, ns.rdzv_endpoint, ns.rdzv_id, conn, conf.get("key_prefix"),
                  int(ns.nnodes.split(":")[-1]), rest if train is None else train, ns.wait)


def finished_line(checkpoint_dir: str, max_steps: int = 0) -> str | None:
    """One line saying the job already finished, from the marker rank 0 writes at the end, or None.
    A larger --max-steps than the marker's step means "train further": not finished."""
    from elastic_mnist.state.fence import read_finished  # imports torch: only once the flags are good

    record = read_finished(checkpoint_dir)
    if record is None or (max_steps and max_steps > int(record["step"])):
        return None
    total = f"/{record['total_steps']}" if record.get("total_steps") else ""
    acc = f", test accuracy {record['test_accuracy']:.4f}" if record.get("test_accuracy") is not None else ""
    return (f"job already finished at step {record['step']}{total}{acc} ({checkpoint_dir}/finished.json); "
            "nothing to do")


def closed_line(launch: Launch) -> str | None:
    """One line when the job's rendezvous is closed, else None (also when unknown). Without the finished
    marker that means a node gave up (torchrun closes the rendezvous when it runs out of restarts): no
    node of this Job can join any more, and only a new Job (a new rendezvous id) resumes."""
    if not launch.run_id:
        return None
    try:
        from elastic_mnist.etcd.rdzv_status import read_rendezvous_status

        status = read_rendezvous_status(launch.endpoint, launch.run_id, launch.backend, launch.key_prefix,
                                        **{"read_timeout": 3.0, **launch.conn})
    except Exception:  # noqa: BLE001 - unknown is not closed: torchrun will report the real problem
        return None
    if status.get("phase") != "closed":
        return None
    return (f"rendezvous {launch.run_id} is closed but the job did not finish (no finished.json): a node gave "
            "up, see the failed pods' logs; delete and re-apply the Job to resume from the newest checkpoint")


def check_data(config) -> str:
    """The worker's own decode and checks (read_split), so preflight and training agree on a bad file."""
    from elastic_mnist.data.mnist import RAW_FILES, read_split

    raw = Path(config.data_dir) / "MNIST" / "raw"
    counts = {}
    for train in (True, False):
        paths = [raw / RAW_FILES[(train, kind)] for kind in ("images", "labels")]
        for path in paths:
            if not path.exists():
                raise Permanent(f"MNIST file {path} is missing; copy MNIST/raw/*-ubyte under --data-dir "
                                "(docs/kubernetes.md: data), or use the download-mnist variant")
        try:
            counts[train] = len(read_split(paths)[1])
        except UserError as e:
            raise Permanent(str(e)) from None
    return f"{raw}: {counts[True]} train, {counts[False]} test images"


def check_checkpoints(config) -> str:
    from elastic_mnist.state.format import ensure_writable

    try:
        method = ensure_writable(config.checkpoint_dir)
    except UserError as e:
        # This node's mount of the volume (or its local disk) refuses the write: node-local. On a
        # shared volume every node fails it, every index fails and with them the Job.
        raise NodeLocal(str(e)) from None
    return f"{config.checkpoint_dir} writable, publish by {method}"


def check_etcd(launch: Launch) -> str:
    return (_check_etcd_v3 if launch.backend == "etcd-v3" else _check_etcd_v2)(launch)


def _check_etcd_v3(launch: Launch) -> str:
    from elastic_mnist.contract.rdzv_conf import EtcdV3ConfigError
    from elastic_mnist.etcd.client import EtcdV3Client, EtcdV3Error
    from elastic_mnist.etcd.secrets import connection_spec, secret  # as the backend reads them

    try:
        secret(launch.conn.get("secret_file"))  # a missing or short rendezvous secret is a config error
        client = EtcdV3Client(connection_spec(launch.endpoint, {"read_timeout": 3.0, **launch.conn}))
        try:
            status = client.call("read the cluster status", lambda c: c.status())
        finally:
            client.close()
    except EtcdV3ConfigError as e:
        raise Permanent(str(e)) from None
    except EtcdV3Error as e:
        if "unreachable" in str(e) or "did not answer" in str(e):
            raise Transient(str(e)) from None
        raise Permanent(str(e)) from None
    return f"{launch.endpoint}: etcd {status.version}, v3 API"


def _check_etcd_v2(launch: Launch) -> str:
    scheme = launch.conn.get("protocol", "http")
    base = launch.endpoint if "://" in launch.endpoint else f"{scheme}://{launch.endpoint}"
    try:
        with urllib.request.urlopen(f"{base}/version", timeout=3) as r:
            version = json.load(r).get("etcdserver", "?")
        with urllib.request.urlopen(f"{base}/v2/keys/", timeout=3):
            pass
    except urllib.error.HTTPError as e:
        raise Permanent(f"etcd at {base} does not serve the v2 API (HTTP {e.code}) that torchrun's `etcd` "
                        "backend needs: run etcd 3.5 with --enable-v2, or use --rdzv-backend=etcd-v3") from None
    except (urllib.error.URLError, OSError) as e:
        raise Transient(f"etcd at {base} is unreachable ({getattr(e, 'reason', e)}); is it running?") from None
    return f"{base}: etcd {version}, v2 API enabled"


def run_checks(launch: Launch, say=print) -> int:
    """The checks in order, one line each; the exit code."""
    try:
        config = parse_args(launch.train_args)
    except (UserError, SystemExit) as e:
        say(f"preflight: flags: FAILED: {e if isinstance(e, UserError) else 'see the usage error above'}")
        return PERMANENT
    done = finished_line(config.checkpoint_dir, config.max_steps)
    if done:
        say(f"preflight: {done}")
        return OK
    checks = (("data", check_data), ("checkpoints", check_checkpoints), ("shm", check_shm), ("device", check_device))
    for name, check in checks:
        try:
            say(f"preflight: {name}: ok: {check(config)}")
        except Permanent as e:
            say(f"preflight: {name}: FAILED (permanent, exit {PERMANENT}): {e}")
            return PERMANENT
        except NodeLocal as e:
            say(f"preflight: {name}: FAILED (this node, exit {NODE_LOCAL}): {e}")
            hold_node_local(say)
            return NODE_LOCAL
    return _wait_for_etcd(launch, say)


def hold_node_local(say, who: str = "preflight", stop: threading.Event | None = None) -> None:
    """Stay running $ELASTIC_MNIST_NODE_LOCAL_HOLD_S before a node-local exit (preflight's, or the pod's when
    its node gave up): the pod is not terminal yet, so the Job creates no replacement until the start
    watchdog has had two sweeps to mark this node."""
    try:
        hold = float(os.environ.get(NODE_LOCAL_HOLD_ENV) or 0)
    except ValueError:
        say(f"{who}: ${NODE_LOCAL_HOLD_ENV}={os.environ[NODE_LOCAL_HOLD_ENV]!r} is not a number of seconds: "
            "exiting without holding")
        return
    if hold > 0:
        say(f"{who}: holding {hold:.0f}s before exit {NODE_LOCAL}, so that this node is marked first")
        (stop or threading.Event()).wait(hold)  # a bounded wait for an outside actor (the watchdog); a stop ends it


def _wait_for_etcd(launch: Launch, say) -> int:
    deadline, delay = time.monotonic() + launch.wait_s, 0.5
    while True:
        try:
            say(f"preflight: etcd: ok: {check_etcd(launch)}")
            ended = closed_line(launch)
            if ended:
                say(f"preflight: rendezvous: FAILED (permanent, exit {PERMANENT}): {ended}")
                return PERMANENT
            return OK
        except Permanent as e:
            say(f"preflight: etcd: FAILED (permanent, exit {PERMANENT}): {e}")
            return PERMANENT
        except Transient as e:
            if time.monotonic() + delay > deadline:
                say(f"preflight: etcd: FAILED (still after {launch.wait_s:.0f}s, exit {TRANSIENT}): {e}")
                return TRANSIENT
            say(f"preflight: etcd: waiting {delay:.1f}s: {e}")
            time.sleep(delay)  # backoff between attempts of a check, not synchronization
            delay = min(delay * 2, 10.0)


def _exit_on_term(signum, _frame):
    # As a container's PID 1 nothing happens on SIGTERM without a handler: a pod deleted while
    # waiting for etcd would sit out its whole grace period.
    sys.exit(killed_by(signum))


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        launch = parse_launch(list(sys.argv[1:] if argv is None else argv))
    except (UserError, ValueError) as e:
        print(f"preflight: flags: FAILED: {e}")
        return PERMANENT
    code = run_checks(launch)
    if kernel_hung():  # a thread stuck in a hung GPU: an interpreter's exit could wait on it (CUDA's teardown)
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
