"""A warm child becomes the worker its stand-in would have been: that process's descriptors, environment,
directory, arguments and session, then its `__main__` run from the top.

    python -m elastic_mnist.warm.server ...    # forks; each child runs Job.run()
"""

from __future__ import annotations

import io
import os
import runpy
import signal
import socket
import sys
import threading

from elastic_mnist import procs
from elastic_mnist.warm import _wire

_RESET = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE)
_REPLACED: list = []  # the warm process's stdio objects: kept, because collecting one would close fd 0/1/2


class Job:
    def __init__(self, request: dict, fds: list[int], conn: socket.socket, server_pid: int) -> None:
        self.request, self.fds, self.conn, self.server_pid = request, fds, conn, server_pid

    def run(self) -> None:
        """Never returns to the server: the target's own exit (or its end) ends this process."""
        request = self.request
        os.setsid()  # a session of its own, as torchrun gives each worker
        for sig in _RESET:
            signal.signal(sig, signal.SIG_IGN if sig == signal.SIGPIPE else signal.SIG_DFL)
        # The warm process ends with its agent: then this worker stops with its group and saves (SIGHUP),
        # as a cold worker does when its agent dies.
        procs.set_parent_death_signal(signal.SIGHUP, parent=self.server_pid)
        for target, fd in zip(_wire.STDIO, self.fds):
            os.dup2(fd, target)
            os.close(fd)
        _reopen_stdio(bool(request.get("unbuffered")))
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[_wire.STARTED_ENV] = repr(float(request["started"]))
        os.chdir(request["cwd"])
        sys.path[:] = request["path"]
        sys.argv[:] = request["argv"]
        _match_threads(os.environ)
        threading.Thread(target=_die_with_stand_in, args=(self.conn,), name="warm-stand-in", daemon=True).start()
        target = request["target"]
        if "module" in target:
            runpy.run_module(target["module"], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target["path"], run_name="__main__")
        sys.exit(0)


def _die_with_stand_in(conn: socket.socket) -> None:
    """The stand-in sends nothing after its request: the end of the stream is its death (torchrun's SIGKILL
    after a stop that took too long, or the node's), and this worker must not outlive it."""
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _reopen_stdio(unbuffered: bool) -> None:
    """Python objects over the new 0/1/2, buffered as the stand-in's interpreter would have them (`-u`)."""
    _REPLACED.extend([sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__])
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False))
    for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        tty = os.isatty(fd)
        raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
        stream = io.TextIOWrapper(raw, errors=errors, write_through=unbuffered, line_buffering=tty or fd == 2)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _match_threads(environ) -> None:
    """torch sized its intra-op pool from the warm process's environment; the worker's may say otherwise."""
    torch = sys.modules.get("torch")
    value = environ.get("OMP_NUM_THREADS", "")
    if torch is not None and value.isdigit() and int(value) > 0 and torch.get_num_threads() != int(value):
        torch.set_num_threads(int(value))
