"""A fork of the warm process becomes a worker: that of a stand-in (its descriptors, environment, directory,
arguments, settings and session), or one started before its round (a node that joins a running job builds
what it trains before it joins), then its `__main__` runs from the top.

    python -m elastic_mnist.warm.server ...    # forks; each child runs Job.run()
"""

from __future__ import annotations

import os
import runpy
import signal
import socket
import sys

from elastic_mnist import procs
from elastic_mnist.contract.warm import Applied, Refused, Request
from elastic_mnist.warm import _wire, kept
from elastic_mnist.warm.become import become

_RESET = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE)


class Job:
    def __init__(self, request: Request, fds: list[int], channel: socket.socket, server_pid: int,
                 in_place: bool) -> None:
        self.request, self.fds, self.channel = request, fds, channel
        self.server_pid, self.in_place = server_pid, in_place

    def run(self) -> None:
        """Never returns to the server: the target's own exit (or its end) ends this process."""
        os.setsid()  # a session of its own, as torchrun gives each worker
        for sig in _RESET:
            signal.signal(sig, signal.SIG_IGN if sig == signal.SIGPIPE else signal.SIG_DFL)
        # The warm process ends with its agent: then this worker stops with its group and saves (SIGHUP),
        # as a cold worker does when its agent dies.
        procs.set_parent_death_signal(signal.SIGHUP, parent=self.server_pid)
        refused = become(self.request, self.fds)
        if refused:  # its stand-in starts cold, and says why
            _wire.send(self.channel, Refused(refused))
            os._exit(0)
        _wire.send(self.channel, Applied())
        kept.install(self.channel, self.request, attached=bool(self.fds), in_place=self.in_place)
        target = self.request.target
        if "module" in target:
            runpy.run_module(target["module"], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target["path"], run_name="__main__")
        sys.exit(0)
