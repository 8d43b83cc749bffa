"""A worker that outlives its round (in-place rounds): what it says to its warm process, and how it takes over
the stand-in torchrun starts for the next round.

    torchrun --rdzv-backend=etcd-v3 ... -m elastic_mnist.train ...    # in_place=1 (the default): rounds in place

torchrun ends its workers at every membership change and starts new ones. Under the etcd-v3 backend the
process torchrun starts is only a stand-in (handoff.py); the worker that trains is a fork of the agent's warm
process, and with in-place rounds it stays: at the end of a round it `detach`es (its stand-in exits with the
code given), then `wait`s for the next round's stand-in, which the warm process hands over (`attach`: its
descriptors, environment and settings become this process's), or for its node's end. The trainer decides what
a round end means (worker/life.py); this module only carries the messages. Standard library only.
"""

from __future__ import annotations

import os
import select
import socket
import time

from elastic_mnist.contract.kept import Wake, hand_over
from elastic_mnist.contract.warm import Attach, Attached, Detach, End, Ready, Refused, Request
from elastic_mnist.warm import _wire
from elastic_mnist.warm.become import become, differences, let_go_of_stdio

TICK_S = 0.2  # how often a waiting worker looks at its stop request (a signal's handler runs between waits)


class Session:  # a contract.kept.KeptSession
    def __init__(self, channel: socket.socket, request: Request, attached: bool) -> None:
        self.channel, self.request, self.attached = channel, request, attached
        self.built_from = request
        """The request this process was built for: a later round's must describe the same worker."""

    def ready(self) -> None:
        """Built before its round: the agent may join now."""
        _wire.send(self.channel, Ready())

    def detach(self, code: int) -> None:
        """The round is over: the stand-in exits with `code`; this process stays for the next round."""
        if self.attached:
            self.attached = False
            let_go_of_stdio()
            _wire.send(self.channel, Detach(code))

    def wait(self, timeout_s: float, stopped) -> tuple[Wake, str]:
        """Until the next round's stand-in is handed over (ATTACH), the node ends (END, why), a stop signal
        comes (STOP), the warm process is gone (END) or `timeout_s` passes (TIMEOUT). An attach that this
        process cannot take is (REFUSE, why): the caller saves, then `refuse(why)`s."""
        deadline = time.monotonic() + timeout_s
        while not stopped():
            left = deadline - time.monotonic()
            if left <= 0:
                return Wake.TIMEOUT, ""
            if not select.select([self.channel], [], [], min(TICK_S, left))[0]:
                continue
            try:
                message, fds = _wire.receive(self.channel, len(_wire.STDIO))
            except (EOFError, _wire.WireError, OSError):
                return Wake.END, "the warm process is gone (its agent ended)"
            if isinstance(message, End):
                return Wake.END, message.why
            if isinstance(message, Attach):
                return self._attach(message.request, fds)
            for fd in fds:  # nothing else comes with descriptors
                os.close(fd)
        return Wake.STOP, ""

    def _attach(self, request: Request, fds: list[int]) -> tuple[Wake, str]:
        why = _wire.check_request(request)
        why = why or (f"the round's worker differs from the one built here ({changed})"
                      if (changed := differences(self.built_from, request)) else "")
        if why:
            for fd in fds:
                os.close(fd)
        why = why or become(request, fds)
        if why:
            return Wake.REFUSE, why
        self.request, self.attached = request, True
        _wire.send(self.channel, Attached())
        return Wake.ATTACH, ""

    def refuse(self, why: str) -> None:
        """Say no to the stand-in just handed over (it is given a fresh worker); this process then exits."""
        _wire.send(self.channel, Refused(why))


def install(channel: socket.socket, request: Request, attached: bool, in_place: bool) -> None:
    """At the fork: this process's session with its warm process (kept only with in-place rounds), handed over
    to the worker's code (contract/kept.py)."""
    hand_over(Session(channel, request, attached) if in_place else None)
