"""A worker that outlives its round and the warm process it was forked from talk through a session, handed
over at the fork: the worker (worker/life.py) sees only this interface, warm/kept.py implements it.

    torchrun --rdzv-backend=etcd-v3 ... -m elastic_mnist.train ...   # in_place=1 (the default): rounds in place

What a session's `wait` answers: ("attach", "") the next round's stand-in was handed over; ("end", why) the
node ends; ("stop", "") a stop signal came; ("timeout", "") none of those in time; ("refuse", why) the handed
stand-in cannot be taken (the caller saves, then `refuse`s it and exits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class KeptSession(Protocol):
    attached: bool
    """True while this round's stand-in is attached (its descriptors and environment are this process's)."""

    def ready(self) -> None:
        """Built before its round: the agent may join now."""

    def detach(self, code: int) -> None:
        """The round is over: the stand-in exits with `code`; this process stays for the next round."""

    def wait(self, timeout_s: float, stopped: Callable[[], bool]) -> tuple[str, str]:
        """Until one of the answers above."""

    def refuse(self, why: str) -> None:
        """Say no to the stand-in just handed over (it is given a fresh worker)."""


_SESSION: list[KeptSession | None] = [None]  # set once, at the fork, before the worker's code runs


def hand_over(session: KeptSession | None) -> None:
    """At the fork (warm/child.py): this process's session, None unless rounds are in place."""
    _SESSION[0] = session


def session() -> KeptSession | None:
    """The session of a worker that may outlive its round; None for any other process."""
    return _SESSION[0]
