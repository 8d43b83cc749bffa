"""The warm process's loop: stand-ins come in, workers are forked or handed their next round, each worker's
exit or detach goes back to its stand-in. One thread; server.py starts it.

    python -m elastic_mnist.warm.server --agent PID --address DIR/warm.sock --token-fd FD [--in-place --plan-on-stdin]

fork() is safe here because this process runs no torch op, starts no thread and never touches CUDA, and
that is proven after every import by a probe child (probe.py) before anything is forked. With --in-place a
worker may outlive its round (kept.py): a later stand-in of its local rank is handed to it instead of a new
fork. Given a plan (plan.py) the worker of each local rank is forked before its first round (a node joining a
running job builds what it trains before it joins).
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys

from elastic_mnist.contract import exit_codes
from elastic_mnist.contract import warm as msg
from elastic_mnist.contract.warm import FAILED, READY, WorkerPlan
from elastic_mnist.warm import _wire, inbox, probe
from elastic_mnist.warm.child import Job
from elastic_mnist.warm.fleet import ATTACHING, BUILDING, IDLE, RUNNING, STARTING, Fleet, Worker
from elastic_mnist.warm.inbox import Inbox
from elastic_mnist.warm.plan import request_for

# What the warm process writes to its --ready-fd: listening, torch imported (and the fork proven safe),
# every worker started before its round built, or one of them ended first (a configuration error, say).


class Server:
    """Accepts stand-ins, forks their workers or hands them to kept ones, reports each worker's exit."""

    def __init__(self, address: str, agent_pid: int, in_place: bool, plan: WorkerPlan | None) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(address)  # in the agent's private directory (0700)
        self.listener.listen(64)  # bound before the imports: a stand-in that comes early waits, not fails
        self.agent_pid, self.agent = agent_pid, os.pidfd_open(agent_pid)
        self.in_place, self.plan = in_place, plan
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.agent, selectors.EVENT_READ, "agent")
        self.fleet, self.inbox = Fleet(), Inbox()
        self.preloads = probe.Preloads()
        self.verdict: int | None = None  # a worker built before its round ended on a configuration error
        self.ready_fd, self.ending, self.control = -1, False, None

    def serve(self) -> Job | None:
        """Until the agent is gone and the workers with it (None); in a forked child, that child's job."""
        while not (self.ending and not len(self.fleet)):
            for key, _ in self.selector.select(self.inbox.timeout()):
                job = self._dispatch(key)
                if job is not None:
                    return job
            for conn in self.inbox.overdue():
                self.selector.unregister(conn)
                self.inbox.drop(conn)
                inbox.refuse(conn, f"bad request: not complete within {inbox.REQUEST_TIMEOUT_S:.0f} s of its connect")
        return None

    def _dispatch(self, key) -> Job | None:
        what = key.data
        if what == "accept":
            self._accept()
        elif what == "request":
            return self._read(key.fileobj)
        elif what == "agent":
            self.end("its agent is gone")
        elif what == "control":
            self._control(key.fileobj)
        elif what == "pidfd":
            return self._reap(self.fleet.by_pidfd[key.fd])
        elif what == "channel":
            return self._from_worker(self.fleet.by_channel[key.fd])
        elif what == "stand_in":
            self._stand_in_gone(key.fileobj)
        return None

    # -- stand-ins ------------------------------------------------------------------------------------
    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        refused = self.inbox.admit(conn, self.agent_pid)  # only the agent's workers are read at all
        if refused:
            inbox.refuse(conn, refused)
        else:
            self.selector.register(conn, selectors.EVENT_READ, "request")

    def _read(self, conn: socket.socket) -> Job | None:
        try:
            done = self.inbox.feed(conn)
        except (EOFError, _wire.WireError, inbox.Stranger) as e:
            self.selector.unregister(conn)
            inbox.turn_away(conn, e)
            return None
        if done is None:
            return None
        self.selector.unregister(conn)
        return self._serve_request(conn, *done)

    def _serve_request(self, conn: socket.socket, data: dict, fds: list[int]) -> Job | None:
        if self.verdict is not None:
            _wire.send(conn, msg.Exit(self.verdict))
            _close(fds, conn)
            return None
        # A module the warm process has not imported is imported by the worker itself, after the fork: an
        # import here would hold every other stand-in of the node for as long as it takes.
        request, refused = _wire.parse_request(data)
        refused = refused or self.preloads.refusal or self._refusal(request)
        if refused or inbox.gone(conn):
            _close(fds)
            inbox.refuse(conn, refused or "gone")
            return None
        return self._route(conn, request, fds)

    def _refusal(self, request: msg.Request) -> str:
        if request.exe != sys.executable or request.version != sys.version:
            return (f"the worker runs {request.exe}, the agent's warm process {sys.executable}: "
                    "start torchrun with the workers' interpreter")
        return ""

    def _route(self, conn: socket.socket, request: msg.Request, fds: list[int]) -> Job | None:
        local_rank = request.env.get("LOCAL_RANK", "0")
        kept = self.fleet.kept_for(local_rank)
        if kept is None:
            return self._fork(request, fds, conn, local_rank)
        if not _wire.send(kept.channel, msg.Attach(request), fds):  # it is exiting: its pidfd says so soon
            return self._fork(request, fds, conn, local_rank)
        kept.state, kept.handed = ATTACHING, (request, fds)  # ours kept until it answers
        self.fleet.bind(kept, conn)
        self.selector.register(conn, selectors.EVENT_READ, "stand_in")
        return None

    def _stand_in_gone(self, conn: socket.socket) -> None:
        """A stand-in sends nothing after its request: readable means it ended (torchrun's SIGKILL after a
        stop that took too long, or its node's). Its worker must not outlive it while it serves it."""
        worker = self.fleet.by_stand_in.get(conn.fileno())
        self.selector.unregister(conn)
        if worker is not None and worker.state in (STARTING, ATTACHING, RUNNING):
            worker.signal(signal.SIGKILL)
            self.fleet.release(worker)

    # -- workers --------------------------------------------------------------------------------------
    def _fork(self, request: msg.Request, fds: list[int], conn: socket.socket | None, local_rank: str) -> Job | None:
        ours, theirs = socket.socketpair()
        server_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            ours.close()
            self._close_in_child(conn)
            return Job(request, fds, theirs, server_pid, self.in_place)
        theirs.close()
        _close(fds)
        worker = Worker(pid, os.pidfd_open(pid), ours, local_rank, STARTING if conn is not None else BUILDING,
                        stand_in=conn)
        self.fleet.add(worker)
        self.selector.register(worker.pidfd, selectors.EVENT_READ, "pidfd")
        self.selector.register(ours, selectors.EVENT_READ, "channel")
        if conn is not None:
            self.selector.register(conn, selectors.EVENT_READ, "stand_in")
        return None

    def _from_worker(self, worker: Worker) -> Job | None:
        try:
            message, _ = _wire.receive(worker.channel)
        except (EOFError, _wire.WireError, OSError):
            self.selector.unregister(worker.channel)  # it is ending: its pidfd reports the rest
            return None
        expected = {STARTING: msg.Applied, ATTACHING: msg.Attached}.get(worker.state)  # (a fork started before its
        if expected and isinstance(message, expected):  # round says Applied too, to nobody: no stand-in waits)
            worker.state, handed, worker.handed, worker.built = RUNNING, worker.handed, None, True
            _close(handed[1] if handed else [])
            if worker.stand_in is not None:
                _wire.send(worker.stand_in, msg.Pid(worker.pid))
        elif isinstance(message, msg.Refused):
            return self._refused(worker, message.why)
        elif isinstance(message, msg.Ready):
            worker.state, worker.built = (IDLE if worker.state == BUILDING else worker.state), True
            self._mark_ready()
        elif isinstance(message, msg.Detach):
            self._unwatch(worker.stand_in)
            self.fleet.release(worker, msg.Exit(message.code))
            worker.state = IDLE
        return None

    def _refused(self, worker: Worker, why: str) -> Job | None:
        """A fresh fork that cannot take its stand-in's settings: the stand-in starts cold. A kept worker that
        cannot take a round (it saved and exits): the stand-in gets a fresh fork."""
        conn, handed = worker.stand_in, worker.handed
        self._unwatch(conn)
        worker.stand_in, worker.handed = None, None
        self.fleet.by_stand_in.pop(conn.fileno() if conn else -1, None)
        if conn is None:
            return None
        if handed is None:
            _wire.send(conn, msg.Refused(why))
            conn.close()
            return None
        print(f"elastic-mnist warm start: the kept worker of local rank {worker.local_rank} left ({why}); a fresh "
              "one takes the round", file=sys.stderr, flush=True)
        worker.state = STARTING  # no longer a candidate for a round
        return self._fork(*handed, conn, worker.local_rank)

    def _reap(self, worker: Worker) -> Job | None:
        self.selector.unregister(worker.pidfd)
        if worker.channel.fileno() in self.selector.get_map():
            self.selector.unregister(worker.channel)
        _, status = os.waitpid(worker.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        self._unwatch(worker.stand_in)
        if not worker.built:
            if code in (exit_codes.PERMANENT, exit_codes.NODE_LOCAL):  # a configuration error, or this node's own
                self.verdict = code  # problem, before its first round: its line was said, and every stand-in of
                # this agent would meet it again: they exit with it
            if worker.state == BUILDING and self.ready_fd >= 0:
                self.mark(FAILED)
        if worker.handed is not None:  # it died while a stand-in was handed to it: a fresh fork takes that
            (request, fds), conn = worker.handed, worker.stand_in
            worker.handed, worker.stand_in = None, None
            self.fleet.by_stand_in.pop(conn.fileno(), None)
            self.fleet.remove(worker)
            if self.verdict is not None:
                _wire.send(conn, msg.Exit(self.verdict))
                _close(fds, conn)
                return None
            return self._fork(request, fds, conn, worker.local_rank)
        self.fleet.release(worker, msg.Exit(code))
        self.fleet.remove(worker)
        return None

    def _unwatch(self, conn: socket.socket | None) -> None:
        if conn is not None and conn.fileno() in self.selector.get_map():
            self.selector.unregister(conn)

    # -- the agent ------------------------------------------------------------------------------------
    def prestart(self) -> Job | None:
        """Fork each local rank's worker before its round (the plan), to build what it trains; in a forked
        child, that child's job."""
        if self.plan is None or not self.in_place or self.preloads.refusal:
            return None
        for local_rank in range(self.plan.local_world_size):
            job = self._fork(request_for(self.plan, local_rank), [], None, str(local_rank))
            if job is not None:
                return job
        return None

    def _mark_ready(self) -> None:
        if not self.fleet.building() and self.ready_fd >= 0:
            self.mark(READY)

    def mark(self, mark: bytes) -> None:
        try:
            os.write(self.ready_fd, mark)
        except OSError:
            pass  # the agent stopped listening (it did not wait for this one)

    def _control(self, conn: socket.socket) -> None:
        """Anything on the agent's stream, or its end, means the agent is ending."""
        self.selector.unregister(conn)
        self.end("its agent ends")

    def end(self, why: str) -> None:
        """The agent ends: every worker saves what it holds and exits; then this process does."""
        if self.ending:
            return
        self.ending = True
        self.selector.unregister(self.listener)
        self.listener.close()
        for worker in list(self.fleet.by_pidfd.values()):
            _wire.send(worker.channel, msg.End(why))

    def _close_in_child(self, conn: socket.socket | None) -> None:
        """A child keeps only its own channel: one holding another's (or a stand-in's connection) would hide
        that process's end from the others."""
        self.selector.close()
        if not self.ending:
            self.listener.close()
        os.close(self.agent)
        for sock in (conn, self.control):
            if sock is not None:
                sock.close()
        for reading in self.inbox.reading.values():
            _close(reading.fds, reading.conn)
        for worker in list(self.fleet.by_pidfd.values()):
            if worker.stand_in is not None:
                worker.stand_in.close()
            _close(worker.handed[1] if worker.handed else [])
            worker.channel.close()
            os.close(worker.pidfd)


def _close(fds: list[int], conn: socket.socket | None = None) -> None:
    for fd in fds:
        os.close(fd)
    if conn is not None:
        conn.close()
