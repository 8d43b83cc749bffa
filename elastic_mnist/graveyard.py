"""What a process kept across rounds still holds of rounds given up with a lost peer, and when it lets go.

    python -m pytest tests/test_graveyard.py -q

A round given up on a lost peer leaves process groups (each with gloo's threads and a socket to every peer)
and collectives that may still wait on the dead peer. Dropping the last reference to such a group joins its
threads, which would block on that wait, so they are kept referenced, and let go as soon as nothing of their
round is in flight: at once after a kill (the peer's reset ends every collective with an error), after the
groups' timeout after a freeze or a vanished host. A worker kept through hundreds of changes thus holds only
the groups of rounds whose collectives still wait.

On gloo a round given up also has its TCP connections cut (`begin_round`, `cut_round`): a collective that torch
waits on by itself (FSDP2's all-gathers and reduce-scatters under --parallel fsdp) cannot be woken from Python,
and on a peer that vanished (no reset) gloo waits in C++ until the collective timeout; gloo's abort() does not
wake an operation already pending (measured on torch 2.14). Shutting down the round's connections does: gloo
fails the operation at once, as when a peer is killed. Every TCP connection this process opened since its
round began is the round's (its store's, its process groups'); listening sockets stay (a store's server
outlives its round), and so does everything older. Linux (/proc).
"""

from __future__ import annotations

import os
import socket
import threading
import time

import torch.distributed as dist

RELEASE_MARGIN_S = 5.0  # past a group's timeout: what its last collective may take to notice it
RELEASE_THREAD = "group-release"


class Graveyard:
    """Groups (and collectives) given up with a lost peer, by round. A round's are kept referenced while one
    of its collectives may still wait on the dead peer (the last reference joins gloo's threads, which would
    block on it), and let go, on a thread of their own, once none does: at once after a kill (the peer's
    reset ends every collective with an error), after the groups' timeout after a freeze or a vanished
    host. So a kept worker that lives through hundreds of changes holds nothing of the rounds before."""

    def __init__(self) -> None:
        self.hold_s = 60.0 + RELEASE_MARGIN_S
        self.round = 0
        self._rounds: dict[int, tuple[float, float, list]] = {}  # round -> (buried at, held until, what was given up)
        self._lock = threading.Lock()

    def bury(self, thing) -> None:
        with self._lock:
            now = time.monotonic()
            _, _, things = self._rounds.setdefault(self.round, (now, now + self.hold_s, []))
            things.append(thing)

    def reap(self) -> None:
        """Let go of every round of which no collective is still in flight, or that is past its hold."""
        now = time.monotonic()
        with self._lock:
            due = [r for r, (_, until, things) in self._rounds.items()
                   if until <= now or all(_settled(t) for t in things)]
            released = [self._rounds.pop(r)[2] for r in due]
        if released:
            threading.Thread(target=released.clear, daemon=True, name=RELEASE_THREAD).start()

    def oldest_s(self) -> float:
        """How long the oldest round still held has been (0 when none is): a round is let go within its hold."""
        with self._lock:
            buried = [since for since, _, _ in self._rounds.values()]
        return round(time.monotonic() - min(buried), 1) if buried else 0.0

    def groups(self) -> int:
        with self._lock:
            return sum(not isinstance(t, dist.Work) for _, _, things in self._rounds.values() for t in things)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(things) for _, _, things in self._rounds.values())


def _settled(thing) -> bool:
    """A group has nothing of its own in flight here (each collective that was is buried beside it)."""
    return not isinstance(thing, dist.Work) or thing.is_completed()


def drained(timeout_s: float = 10.0) -> bool:
    """Wait until every release in progress is done (tests; the worker never waits on one)."""
    deadline = time.monotonic() + timeout_s
    for thread in [t for t in threading.enumerate() if t.name == RELEASE_THREAD]:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.name == RELEASE_THREAD for t in threading.enumerate())


# -- a given-up round's connections ---------------------------------------------------------------------
_FDS = "/proc/self/fd"
_ROUND: list[tuple[int, frozenset]] = [(0, frozenset())]
"""(the round's number, the inodes of the sockets this process held as it began), swapped whole."""


def _sockets() -> dict[int, int]:
    """This process's socket descriptors, fd -> inode."""
    out = {}
    for name in os.listdir(_FDS) if os.path.isdir(_FDS) else ():
        try:
            link = os.readlink(f"{_FDS}/{name}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            out[int(name)] = int(link[len("socket:["):-1])
    return out


def begin_round() -> int:
    """A round begins: what this process holds now is not the round's. Its number, for `cut_round`."""
    number = _ROUND[0][0] + 1
    _ROUND[0] = (number, frozenset(_sockets().values()))
    return number


def round_number() -> int:
    return _ROUND[0][0]


def cut_round(number: int) -> int:
    """From any thread: shut down (never close: their owners do) round `number`'s TCP connections; how many.
    Nothing once a later round began (a watch thread of a round already over), nor before any did."""
    current, before = _ROUND[0]
    if number != current or not current:
        return 0
    cut_now = 0
    for fd, inode in _sockets().items():
        if inode not in before and _ROUND[0][0] == number and _shut(fd, inode):
            cut_now += 1
    return cut_now


def _shut(fd: int, inode: int) -> bool:
    """Shut down the TCP connection behind `fd` if it is still `inode`: through a duplicate, so a descriptor
    closed and reused meanwhile is never the one shut down."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False  # closed meanwhile
    try:
        if os.fstat(dup).st_ino != inode:
            return False
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return False
    with sock:  # closes the duplicate only: the connection's owner still holds it
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                return False
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return False  # a store's server outlives its round
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False  # not connected (yet, or any more)
