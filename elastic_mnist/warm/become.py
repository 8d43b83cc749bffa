"""A process of the warm family becoming the worker a stand-in describes: its descriptors, environment,
directory, import path, arguments and process settings. A fresh fork does it once; a kept worker again at
every round, for the stand-in torchrun started for that round.

    python -m elastic_mnist.warm.server ...    # its forks call become(request, fds)
"""

from __future__ import annotations

import io
import os
import sys

from elastic_mnist.contract.env import PREFIX, set_started_at
from elastic_mnist.contract.warm import Request
from elastic_mnist.warm import _wire, settings

_REPLACED: list = []  # the interpreter's own stdio objects: kept, because collecting one would close fd 0/1/2
_OWN: list[int] = []  # copies of the warm process's stdio (its agent's), for a kept worker between rounds
# Set per round by torchrun (and by our agent), so they may differ between the rounds a kept worker serves;
# anything else in the environment must be what the worker was built with.
ROUND_ENV = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_", "ROLE_", "WORLD_SIZE", "MASTER_", "TORCHELASTIC_",
             "TORCH_NCCL_", "NCCL_ASYNC_ERROR_HANDLING", PREFIX, "CUDA_MODULE_LOADING")


def become(request: Request, fds: list[int]) -> str:
    """Take the request over in this process; "" when done, else why not (nothing was changed then)."""
    refused = settings.apply(request.settings) if request.settings else ""
    if refused:
        for fd in fds:
            os.close(fd)
        return refused
    if fds and not _OWN:
        _OWN.extend(os.dup(fd) for fd in _wire.STDIO)
    for target, fd in zip(_wire.STDIO, fds):
        os.dup2(fd, target)
        os.close(fd)
    if fds:
        _reopen_stdio(request.unbuffered)
    os.environ.clear()
    os.environ.update(request.env)
    set_started_at(os.environ, request.started)
    os.chdir(request.cwd)
    sys.path[:] = request.path
    sys.argv[:] = request.argv
    _match_threads(os.environ)
    return ""


def let_go_of_stdio() -> None:
    """A kept worker between rounds: back to the warm process's stdio (its agent's), so the stand-in's pipes
    and log files (torchrun's per-attempt --log-dir files) close when it exits."""
    if _OWN:
        for target, fd in zip(_wire.STDIO, _OWN):
            os.dup2(fd, target)
        _reopen_stdio(unbuffered=True)


def differences(built: Request, now: Request) -> str:
    """What makes a round's request another worker than the one built from `built` ("" when none)."""
    same = ("exe", "version", "target", "cwd")
    changed = [k for k in same if getattr(built, k) != getattr(now, k)]
    if built.argv[1:] != now.argv[1:]:
        changed.append("arguments")
    a, b = _fixed_env(built.env), _fixed_env(now.env)
    changed += sorted(f"${k}" for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return ", ".join(changed)


def _fixed_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if not k.startswith(ROUND_ENV)}


def _reopen_stdio(unbuffered: bool) -> None:
    """Python objects over the new 0/1/2, buffered as the stand-in's interpreter would have them (`-u`)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    for stream in (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__):
        if _closes_its_fd(stream) and not any(stream is kept for kept in _REPLACED):
            _REPLACED.append(stream)  # the interpreter's own: ours (closefd=False) may go, every round's
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False))
    for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        tty = os.isatty(fd)
        raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
        stream = io.TextIOWrapper(raw, errors=errors, write_through=unbuffered, line_buffering=tty or fd == 2)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _closes_its_fd(stream) -> bool:
    raw = getattr(stream, "buffer", stream)
    return bool(getattr(getattr(raw, "raw", raw), "closefd", True))


def _match_threads(environ) -> None:
    """torch sized its intra-op pool from the warm process's environment; the worker's may say otherwise."""
    torch = sys.modules.get("torch")
    value = environ.get("OMP_NUM_THREADS", "")
    if torch is not None and value.isdigit() and int(value) > 0 and torch.get_num_threads() != int(value):
        torch.set_num_threads(int(value))
