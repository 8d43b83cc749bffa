"""What a worker's stand-in and the warm process say to each other: one request (a length, the worker's
stdin/stdout/stderr as SCM_RIGHTS, then JSON), then JSON lines back ({"pid": N}, later {"exit": CODE}).

    python -c "from elastic_mnist.warm import _wire; print(_wire.new_address())"

The socket is an abstract Unix socket: no file to remove, gone with the process that bound it, and local
to the network namespace (each simulated host of `elastic-mnist local --hosts` has its own). It has no
permissions, so the warm process serves only connections from its own user (SO_PEERCRED): that user can
run anything as itself already.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct

from elastic_mnist import procs

ADDRESS_ENV = procs.WARM_ADDRESS_ENV
STARTED_ENV = procs.STARTED_AT_ENV
STDIO = (0, 1, 2)
_LEN = struct.Struct("!I")
MAX_REQUEST = 1 << 22


def new_address() -> str:
    return f"@elastic-mnist-warm-{os.getuid()}-{os.getpid()}-{secrets.token_hex(8)}"


def sockaddr(address: str) -> str:
    return "\0" + address[1:] if address.startswith("@") else address


def send_request(sock: socket.socket, request: dict) -> None:
    payload = json.dumps(request).encode()
    socket.send_fds(sock, [_LEN.pack(len(payload))], list(STDIO))
    sock.sendall(payload)


def recv_request(sock: socket.socket) -> tuple[dict, list[int]]:
    """The request and the descriptors that came with it (the caller owns and closes them)."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _LEN.size, len(STDIO))
    try:
        if len(head) != _LEN.size or len(fds) != len(STDIO):
            raise ValueError("a short request")
        (size,) = _LEN.unpack(head)
        if size > MAX_REQUEST:
            raise ValueError(f"a request of {size} bytes")
        return json.loads(_recv_exact(sock, size)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            raise ValueError("the request ended early")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def send_line(sock: socket.socket, message: dict) -> bool:
    """False when the other side is gone (a stand-in killed meanwhile)."""
    try:
        sock.sendall(json.dumps(message).encode() + b"\n")
        return True
    except OSError:
        return False


class Lines:
    """JSON lines from a socket; `next()` is None once the other side closed."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def next(self) -> dict | None:
        while b"\n" not in self.buf:
            try:
                chunk = self.sock.recv(4096)
            except OSError:
                return None
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[2]
