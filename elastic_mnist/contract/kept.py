"""A worker that outlives its round and the warm process it was forked from talk through a session, handed
over at the fork: the worker (worker/life.py) sees only this interface, warm/kept.py implements it.

    torchrun --rdzv-backend=etcd-v3 ... -m elastic_mnist.train ...   # in_place=1 (the default): rounds in place

A session's `wait` answers a Wake and a line saying why (where there is one).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Protocol


class Wake(Enum):
    """Why a kept worker's wait between rounds ended."""

    ATTACH = "attach"  # the next round's stand-in was handed over: train it
    END = "end"  # the node ends (its agent ends, or the warm process is gone): save and exit
    STOP = "stop"  # a stop signal came
    TIMEOUT = "timeout"  # no round within --round-timeout
    REFUSE = "refuse"  # the handed stand-in cannot be taken: save, `refuse` it (it gets a fresh worker), exit


class KeptSession(Protocol):
    attached: bool
    """True while this round's stand-in is attached (its descriptors and environment are this process's)."""

    def ready(self) -> None:
        """Built before its round: the agent may join now."""

    def detach(self, code: int) -> None:
        """The round is over: the stand-in exits with `code`; this process stays for the next round."""

    def wait(self, timeout_s: float, stopped: Callable[[], bool]) -> tuple[Wake, str]:
        """Until one of the Wakes, with its why ("" for ATTACH, STOP and TIMEOUT)."""

    def refuse(self, why: str) -> None:
        """Say no to the stand-in just handed over (it is given a fresh worker)."""


_SESSION: list[KeptSession | None] = [None]  # set once, at the fork, before the worker's code runs


def hand_over(session: KeptSession | None) -> None:
    """At the fork (warm/child.py): this process's session, None unless rounds are in place."""
    _SESSION[0] = session


def session() -> KeptSession | None:
    """The session of a worker that may outlive its round; None for any other process."""
    return _SESSION[0]
