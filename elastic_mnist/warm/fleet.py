"""The warm process's workers: which fork serves which local rank, which stand-in it reports to, and what it
is doing (starting, building before its round, idle between rounds, attaching, running a round).

    python -m elastic_mnist.warm.server ...    # the Server keeps one Fleet

Every worker is a fork with a socketpair to the warm process (warm/_wire.py) and a pidfd the warm process
watches. A worker's stand-in is what torchrun sees: it reports the worker's exit, or its detach (the round is
over, the worker stays), and a stand-in that dies (torchrun's SIGKILL) takes its running worker with it.
"""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass

from elastic_mnist.contract.warm import Exit, Request
from elastic_mnist.warm import _wire

STARTING, BUILDING, IDLE, ATTACHING, RUNNING = "starting", "building", "idle", "attaching", "running"


@dataclass
class Worker:
    pid: int
    pidfd: int
    channel: socket.socket
    local_rank: str
    state: str
    built: bool = False
    """It got as far as a round (or ready for one): an exit from here on is a worker's, not a build's."""
    stand_in: socket.socket | None = None
    """The connection of the stand-in this worker reports to (while starting, attaching or running)."""
    handed: tuple[Request, list[int]] | None = None
    """While attaching: the stand-in's request and (the warm process's copies of) its descriptors, to fork a
    fresh worker for it if this one refuses the round."""

    def signal(self, signum: int) -> None:
        try:
            signal.pidfd_send_signal(self.pidfd, signum)
        except ProcessLookupError:
            pass


class Fleet:
    def __init__(self) -> None:
        self.by_pidfd: dict[int, Worker] = {}
        self.by_channel: dict[int, Worker] = {}
        self.by_stand_in: dict[int, Worker] = {}

    def add(self, worker: Worker) -> None:
        self.by_pidfd[worker.pidfd] = worker
        self.by_channel[worker.channel.fileno()] = worker
        if worker.stand_in is not None:
            self.by_stand_in[worker.stand_in.fileno()] = worker

    def remove(self, worker: Worker) -> None:
        self.by_pidfd.pop(worker.pidfd, None)
        self.by_channel.pop(worker.channel.fileno(), None)
        self.release(worker)
        worker.channel.close()
        os.close(worker.pidfd)

    def bind(self, worker: Worker, stand_in: socket.socket) -> None:
        worker.stand_in = stand_in
        self.by_stand_in[stand_in.fileno()] = worker

    def release(self, worker: Worker, report: Exit | None = None) -> None:
        """The worker is done with its stand-in: tell it `report` (its exit), and let it go."""
        conn, worker.stand_in = worker.stand_in, None
        if conn is None:
            return
        self.by_stand_in.pop(conn.fileno(), None)
        if report is not None:
            _wire.send(conn, report)
        conn.close()

    def kept_for(self, local_rank: str) -> Worker | None:
        """A worker of that local rank free to take a round (built, or between rounds)."""
        return next((w for w in self.by_pidfd.values() if w.local_rank == local_rank and w.state in (BUILDING, IDLE)),
                    None)

    def building(self) -> list[Worker]:
        return [w for w in self.by_pidfd.values() if w.state == BUILDING]

    def __len__(self) -> int:
        return len(self.by_pidfd)
