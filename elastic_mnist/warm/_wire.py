"""What the agent's warm process, the workers' stand-ins and its forked workers say to each other.

    python -c "from elastic_mnist.warm import _wire; print(_wire.parse_request({}))"

Every message is a 4-byte length and JSON; descriptors (SCM_RIGHTS) ride with the length. The messages are
contract/warm.py's (Pid, Exit, Refused, Applied, Ready, Attach, Attached, Detach, End), encoded there.
- A stand-in sends one request (`request_from_here`: its command, environment, directory, process settings)
  with its stdin/stdout/stderr, and gets back Pid (or Refused: it starts cold), later Exit.
- The warm process and each worker it forked share a socketpair made at the fork: Applied or Refused (the
  worker's process settings, at once); Ready (a worker started before its round has built what it trains);
  Attach with the stand-in's descriptors, answered Attached or Refused; Detach (the round is over, the
  worker stays); End (its agent ends).
The socket is a path in the agent's private directory (0700, agent_link.py), and the warm process serves
only its own user's processes that are children of its agent (SO_PEERCRED) and whose request carries the
token its agent handed its workers (WARM_TOKEN_ENV; a re-parented orphan of an agent that is PID 1 has none):
torchrun's workers.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import sys

from elastic_mnist.contract.warm import Message, Request, decode, encode
from elastic_mnist.warm import settings

STDIO = (0, 1, 2)
_LEN = struct.Struct("!I")
HEAD_SIZE = _LEN.size
MAX_MESSAGE = 1 << 22


class WireError(ValueError):
    """A message that is short, too long, or not the JSON object the protocol says."""


def send(sock: socket.socket, message: Message, fds: tuple[int, ...] | list[int] = ()) -> bool:
    """False when the other side is gone."""
    return _send_json(sock, encode(message), fds)


def send_request(sock: socket.socket, request: Request, fds: tuple[int, ...] | list[int] = ()) -> bool:
    """A stand-in's request, the one thing it sends (False when the warm process is gone)."""
    return _send_json(sock, request.to_json(), fds)


def _send_json(sock: socket.socket, data: dict, fds: tuple[int, ...] | list[int]) -> bool:
    payload = json.dumps(data).encode()
    try:
        socket.send_fds(sock, [_LEN.pack(len(payload))], list(fds))
        sock.sendall(payload)
        return True
    except OSError:
        return False


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[Message, list[int]]:
    """One message and the descriptors that came with it (the caller owns them); EOFError when the other
    side closed, WireError for anything else than a message of the protocol (descriptors closed)."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _LEN.size, max_fds)
    if not head and not fds:
        raise EOFError
    try:
        if len(head) != _LEN.size:
            raise WireError("a short message")
        return decode(json.loads(_recv_exact(sock, message_size(head)))), fds
    except (WireError, ValueError, OSError) as e:
        for fd in fds:
            os.close(fd)
        raise WireError(str(e)) from None


def message_size(head: bytes) -> int:
    """The size a message's 4-byte head announces; WireError beyond MAX_MESSAGE."""
    (size,) = _LEN.unpack(head)
    if size > MAX_MESSAGE:
        raise WireError(f"a message of {size} bytes")
    return size


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            raise WireError("the message ended early")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def parse_request(data: object) -> tuple[Request | None, str]:
    """(the request, "") when `data` is one a stand-in sends (types, keys and values), else (None, what is wrong
    with it), one line: never a traceback in the warm process or in a fork of it. Everything a fork would act
    on is checked here, before anything is forked."""
    try:
        request = Request.from_json(data)
    except ValueError as e:
        return None, f"malformed request: {e}"
    why = check_request(request)
    return (None, why) if why else (request, "")


def check_request(request: Request) -> str:
    """"" when the values of a request (its types are the dataclass's) are ones a fork can act on."""
    why = _check_values(request)
    if not why and request.settings:
        why = settings.check(request.settings)
    return f"malformed request: {why}" if why else ""


def _check_values(request: Request) -> str:
    target = request.target
    if not ((isinstance(target.get("module"), str) and target["module"])
            or (isinstance(target.get("path"), str) and os.path.isabs(target["path"]))):
        return "'target' names no module and no absolute path"
    for name in ("argv", "path", "preload"):
        if not all(isinstance(x, str) and "\0" not in x for x in getattr(request, name)):
            return f"{name!r} holds something other than strings"
    if not request.argv:
        return "'argv' is empty"
    if not all(isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
               for k, v in request.env.items()):
        return "'env' holds something other than NAME=VALUE strings"
    if not (os.path.isabs(request.cwd) and os.path.isdir(request.cwd)):
        return f"'cwd' {request.cwd[:200]!r} is not an existing directory"
    if not (math.isfinite(request.started) and request.started >= 0):
        return f"'started' {request.started!r} is not a time"
    return ""


def request_from_here(preload: tuple[str, ...], started: float, process_settings: dict, token: str = "") -> Request:
    """This process's command as a request: what a warm child needs to become it (`token`: its agent's)."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    target = {"module": spec.name} if spec is not None else {"path": os.path.abspath(main.__file__)}
    return Request(exe=sys.executable, version=sys.version, argv=list(sys.argv), path=list(sys.path), cwd=os.getcwd(),
                   env=dict(os.environ), target=target, preload=list(preload), started=started,
                   unbuffered=bool(getattr(sys.stdout, "write_through", False)),  # python -u, $PYTHONUNBUFFERED
                   settings=process_settings, token=token)


def peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end (SO_PEERCRED)."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    return pid, uid

