"""The worker's side of a warm start: hand this process's command to the agent's warm process, then stand
in for the child it forks until that child exits.

    ELASTIC_MNIST_WARM=DIR/warm.sock python -m elastic_mnist.train ...   # the agent sets it for its workers

Without the variable, or when the warm process cannot take the request (gone, another interpreter, CUDA
already initialised in it), `handoff()` returns and the worker starts cold, as if it had not been called.
Standard library only: this runs before torch is imported.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time

from elastic_mnist import agent_link, procs
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.env import started_at, take_warm
from elastic_mnist.contract.warm import Exit, Pid, Refused
from elastic_mnist.warm import _wire, settings

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
REPLY_TIMEOUT_S = 900.0
"""How long to wait for the worker's pid: on a node's first start the warm process may still be importing, or
the worker started before its round still building (rendezvous/_warm_start.py READY_TIMEOUT_S)."""


class _StandIn:
    """Signals for the child: held until its pid is known, then forwarded as they come."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.pidfd: int | None = None
        self.signalled = False  # a stop came (from the agent, as a rule): the round's end need not wait for it
        self.saved = {sig: signal.getsignal(sig) for sig in FORWARDED}
        for sig in FORWARDED:
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signalled = True
        if self.pidfd is None:
            self.pending.append(signum)
        else:
            _send(self.pidfd, signum)

    def attach(self, pid: int) -> None:
        try:
            self.pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # it already ended; its status is on the way
            self.pidfd = -1
        for signum in self.pending:
            _send(self.pidfd, signum)

    def give_back(self) -> None:
        """No warm start: the handlers before ours, then the signals that came meanwhile, in order."""
        for sig, handler in self.saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        for signum in self.pending:
            signal.raise_signal(signum)


def _send(pidfd: int, signum: int) -> None:
    if pidfd >= 0:
        try:
            signal.pidfd_send_signal(pidfd, signum)
        except ProcessLookupError:
            pass


def handoff(preload: tuple[str, ...] = ()) -> None:
    """Run this process's command in a warm child and never return, or return at once (start cold).
    `preload`: modules the warm process imports when it starts, once per node (its agent reads this call's
    literal list from the script, plan.declared_preload); one it has not imported, the worker imports itself."""
    address, token = take_warm()  # the agent's: for its warm process only, never the worker's
    if not address or started_at() is not None or not hasattr(os, "pidfd_open"):
        return
    started = time.time()
    stand_in = _StandIn()
    procs.set_parent_death_signal(signal.SIGHUP)  # our agent dies: the child stops with its group and saves
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    first = None
    try:
        sock.settimeout(REPLY_TIMEOUT_S)
        sock.connect(address)
        request = _wire.request_from_here(preload, started, settings.capture(), token)
        if _wire.send_request(sock, request, _wire.STDIO):
            first, _ = _wire.receive(sock)
    except (OSError, EOFError, _wire.WireError):
        pass
    if isinstance(first, Exit):  # the worker built for this agent already ended on a configuration error
        _finish(first.code, stand_in.signalled)
    if not isinstance(first, Pid):
        sock.close()
        stand_in.give_back()
        if isinstance(first, Refused) and first.why:
            print(f"elastic-mnist warm start: starting cold: {first.why}", file=sys.stderr, flush=True)
        return
    sock.settimeout(None)
    stand_in.attach(first.pid)
    code = _wait(sock, stand_in.pidfd)
    _finish(code, stand_in.signalled)


def _wait(sock: socket.socket, pidfd: int) -> int:
    """The worker's exit status (a code, or minus the signal that ended it), or the code of its detach (an
    in-place round is over and the worker stays for the next)."""
    while True:
        try:
            message, _ = _wire.receive(sock)
        except (OSError, EOFError, _wire.WireError):
            break
        if isinstance(message, Exit):
            return message.code
    # The warm process is gone (its agent died): its child stops on its own (parent-death signal); be
    # there until it is gone, so the agent's view of this worker ends when the worker does.
    if pidfd >= 0:
        select.select([pidfd], [], [])
    return exit_codes.FAILURE


def _finish(code: int, stopped: bool) -> None:
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught, nor reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = exit_codes.killed_by(-code)
    agent_link.end_process(code, stopped=stopped)  # a round ended for a membership change: restarted uncounted
