"""The stand-ins' requests while they are read: each connection is read as its bytes come, beside every
other, and must be complete within REQUEST_TIMEOUT_S of its connect. The warm process has one thread, so a
blocking read of one request would hold every other stand-in of its node (and the exits it reports) for as
long as that client dribbles; here a slow client only delays itself, and is refused at its deadline.

    python -m elastic_mnist.warm.server ...    # the Server keeps one Inbox
"""

from __future__ import annotations

import hmac
import json
import os
import select
import socket
import sys
import time

from elastic_mnist import procs
from elastic_mnist.contract.warm import Refused, Request
from elastic_mnist.warm import _wire

REQUEST_TIMEOUT_S = 10.0  # a stand-in sends its request at once: microseconds


class Stranger(Exception):
    """A complete request without the agent's token: from no process the agent started. It gets nothing."""


class _Reading:
    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.conn, self.pid, self.deadline = conn, pid, time.monotonic() + REQUEST_TIMEOUT_S
        self.head, self.body, self.fds, self.size = b"", bytearray(), [], -1

    def feed(self) -> tuple[dict, list[int]] | None:
        """Take what has come; the message and its descriptors once complete. EOFError when the client
        closed, WireError when what came is no message of the protocol."""
        if self.size < 0:
            data, fds, _flags, _addr = socket.recv_fds(self.conn, _wire.HEAD_SIZE - len(self.head),
                                                       len(_wire.STDIO))
            self.fds += fds
            if not data:
                raise EOFError
            self.head += data
            if len(self.head) == _wire.HEAD_SIZE:
                self.size = _wire.message_size(self.head)
        else:
            data = self.conn.recv(min(self.size - len(self.body), 1 << 16))
            if not data:
                raise _wire.WireError("the message ended early")
            self.body += data
        if len(self.fds) > len(_wire.STDIO):
            raise _wire.WireError("a message with more descriptors than stdin, stdout and stderr")
        if self.size < 0 or len(self.body) < self.size:
            return None
        message = json.loads(self.body)
        if not isinstance(message, dict):
            raise _wire.WireError("a message that is not a JSON object")
        if len(self.fds) != len(_wire.STDIO):
            raise _wire.WireError("a request without the stand-in's stdin, stdout and stderr")
        return message, self.fds


class Inbox:
    """Every request being read, by the fd of its connection."""

    def __init__(self) -> None:
        self.reading: dict[int, _Reading] = {}
        self.token = b""  # the agent's, from --token-fd: no request is served without it

    def admit(self, conn: socket.socket, agent_pid: int) -> str:
        """Read `conn` from now on if its process is one of its agent's workers ("" then), else why not."""
        pid, uid = _wire.peer(conn)
        if uid != os.getuid() or procs.proc_ppid(pid) != agent_pid:
            return f"bad request: pid {pid} (uid {uid}) is not a worker of this agent"
        conn.setblocking(False)
        self.reading[conn.fileno()] = _Reading(conn, pid)
        return ""

    def feed(self, conn: socket.socket) -> tuple[dict, list[int]] | None:
        """The request on `conn` once complete (no longer in the inbox then, its connection blocking again);
        None while more is to come. Errors as _Reading.feed, the connection's descriptors closed."""
        reading = self.reading[conn.fileno()]
        try:
            done = reading.feed()
        except BlockingIOError:
            return None
        except (EOFError, _wire.WireError, ValueError, OSError) as e:
            self.drop(conn)
            raise e if isinstance(e, EOFError) else _wire.WireError(str(e)) from None
        if done is None:
            return None
        del self.reading[conn.fileno()]
        conn.setblocking(True)
        if not (self.token and hmac.compare_digest(Request.take_token(done[0]).encode(), self.token)):
            for fd in done[1]:
                os.close(fd)
            raise Stranger(f"refused pid {reading.pid}: its request carries no token of this agent (a process the "
                           "agent did not start: its workers get the token in their environment)")
        return done

    def drop(self, conn: socket.socket) -> None:
        reading = self.reading.pop(conn.fileno(), None)
        for fd in reading.fds if reading else ():
            os.close(fd)

    def timeout(self) -> float | None:
        """Until the nearest deadline (None: no request being read)."""
        if not self.reading:
            return None
        return max(0.0, min(r.deadline for r in self.reading.values()) - time.monotonic())

    def overdue(self) -> list[socket.socket]:
        now = time.monotonic()
        return [r.conn for r in self.reading.values() if r.deadline <= now]


def gone(conn: socket.socket) -> bool:
    """The stand-in gave up meanwhile (it starts cold then): forking for it would run the worker twice."""
    if not select.select([conn], [], [], 0)[0]:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def turn_away(conn: socket.socket, error: Exception) -> None:
    """A request that is not served: a stranger is told nothing, not even why (that goes to the agent's log);
    anyone else one line."""
    if isinstance(error, Stranger):
        print(f"elastic-mnist warm start: {error}", file=sys.stderr, flush=True)
        conn.close()
    else:
        refuse(conn, f"bad request: {error or 'the stand-in closed'}")


def refuse(conn: socket.socket, why: str) -> None:
    """One line for the stand-in (it starts cold, saying it), and its connection closed."""
    conn.setblocking(True)
    _wire.send(conn, Refused(why))
    conn.close()
