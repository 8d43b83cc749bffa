"""The agent's side of its warm process: start it, wait for what this node needs before it joins, end it.

    torchrun --rdzv-backend=etcd-v3 ... -m elastic_mnist.train ...   # create_rdzv_handler calls start_for_workers

The warm process listens on a socket in the agent's private directory (agent_link.py), serves only requests
that carry the token this agent hands its workers in their environment (and the warm process on a pipe),
and tells its progress on a pipe: listening, warm (torch imported, a fork proven safe), ready (each local
rank's worker built before its round: in-place rounds with a known plan), or failed (such a worker ended
first: the agent looks for the configuration error it reported). It ends with the agent: at the agent's exit
its workers first save what they hold (within END_TIMEOUT_S), and if the agent dies it gets SIGKILL and its
workers SIGHUP.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import time

from elastic_mnist import procs
from elastic_mnist.contract.env import set_warm
from elastic_mnist.contract.warm import (
    FAILED,
    LISTENING,
    MAX_PATH,
    PROBE_TIMEOUT_S,
    READY,
    SERVER_MODULE,
    WARM,
    WorkerPlan,
    address_in,
)

LISTEN_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 900.0  # a joiner's workers: imports, --startup-cost, data, model; progress every 30 s
END_TIMEOUT_S = 30.0  # what the workers' saves may take when their agent ends (inside a pod's grace period)
PROGRESS_S = 30.0


class WarmProcess:
    def __init__(self, proc: subprocess.Popen, control: socket.socket, marks: int) -> None:
        self.proc, self.control, self._marks = proc, control, marks

    def wait(self, wanted: bytes, timeout_s: float, what: str) -> bytes:
        """Read progress marks until `wanted` or FAILED (returned), or b"" at the timeout; says so every
        PROGRESS_S while it waits."""
        deadline, said = time.monotonic() + timeout_s, time.monotonic()
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([self._marks], [], [], min(left, PROGRESS_S))[0]:
                print(f"elastic-mnist warm start: still waiting for {what} ({time.monotonic() - said:.0f} s)",
                      file=sys.stderr, flush=True)
                continue
            mark = os.read(self._marks, 1)
            if mark in (wanted, FAILED) or not mark:
                return mark
        return b""

    def end(self, timeout_s: float = END_TIMEOUT_S) -> None:
        """The agent ends: its workers save what they hold and exit, then the warm process (bounded). Safe to
        repeat."""
        if self._marks < 0:
            return
        self.control.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            print(f"elastic-mnist warm start: the workers did not end within {timeout_s:.0f} s of their agent; "
                  "killing them", file=sys.stderr, flush=True)
            procs.signal_tree(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.close(self._marks)
        self._marks = -1


def start_for_workers(agent_dir: str, environ=os.environ, in_place: bool = True, plan: WorkerPlan | None = None,
                      wait_ready: bool = False, probe_timeout_s: float = PROBE_TIMEOUT_S,
                      preload: tuple[str, ...] = ()) -> WarmProcess | None:
    """In the torchrun agent: start its warm process and point the workers it starts at it, once it listens;
    with `wait_ready`, once it has built each local rank's worker too. None where it cannot start (workers
    start cold)."""
    address = address_in(agent_dir)
    if not hasattr(os, "pidfd_open") or len(address) > MAX_PATH:
        why = "no pidfd" if len(address) <= MAX_PATH else f"{address} is too long a socket path: shorten $TMPDIR"
        print(f"elastic-mnist warm start: no warm process ({why}); workers start cold", file=sys.stderr, flush=True)
        return None
    marks_r, marks_w = os.pipe()
    token_r, token_w = os.pipe()  # the token the agent's workers carry: not in `ps`, not in its environment
    ours, theirs = socket.socketpair()
    command = [sys.executable, "-m", SERVER_MODULE, "--agent", str(os.getpid()), "--address", address,
               "--ready-fd", str(marks_w), "--control-fd", str(theirs.fileno()), "--token-fd", str(token_r),
               "--probe-timeout", str(probe_timeout_s), *(["--in-place"] if in_place else []),
               *(f"--preload={name}" for name in preload),
               *(["--plan-on-stdin"] if plan else [])]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE if plan else subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=procs.die_with_parent_preexec(), pass_fds=[marks_w, theirs.fileno(), token_r])
    os.close(marks_w)
    os.close(token_r)
    token = secrets.token_hex(16)
    os.write(token_w, token.encode())
    os.close(token_w)
    theirs.close()
    if plan is not None:  # on stdin, not among the arguments everyone sees in `ps`
        proc.stdin.write(json.dumps(plan.to_json()).encode())
        proc.stdin.close()
    warm = WarmProcess(proc, ours, marks_r)
    atexit.register(warm.end)
    if warm.wait(LISTENING, LISTEN_TIMEOUT_S, "the warm process to listen") != LISTENING:
        print("elastic-mnist warm start: the warm process did not start; workers start cold", file=sys.stderr)
        return None
    set_warm(environ, address, token)
    if wait_ready:
        _before_joining(warm, build=in_place and plan is not None)
    return warm


def _before_joining(warm: WarmProcess, build: bool) -> None:
    """A node joining a running job makes it wait only for the process-group change: its warm process imports
    torch first (and with in-place rounds builds each worker), the running nodes training on meanwhile."""
    started = time.monotonic()
    what = "building this node's workers" if build else "importing torch"
    print(f"elastic-mnist warm start: {what} before this node joins the running job", file=sys.stderr, flush=True)
    wanted = READY if build else WARM
    mark = warm.wait(wanted, READY_TIMEOUT_S, "this node's workers to build" if build else "the warm process")
    print(f"elastic-mnist warm start: {'done' if mark == wanted else 'not done'} after "
          f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
