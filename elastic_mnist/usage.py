"""What a process holds right now: threads, open descriptors, sockets, resident memory (Linux /proc).

    python -c 'from elastic_mnist.usage import usage; print(usage())'

A kept worker journals it at every round's end ("round_end"), so a long run shows whether anything grows
with the number of rounds (bench/soak.py plots it; tests/e2e/test_kept_flat.py asserts it stays flat).

`fds` leaves out libuv's io_uring ring and its eventfd: libuv makes them once per process, the first time the
process hosts a round's TCPStore (its rank 0), and keeps them for the process's life. Counted, a kept
worker's first turn as rank 0 would read as a descriptor leaked that round.
"""

from __future__ import annotations

import os


def usage(pid: int | str = "self") -> dict:
    """{"threads", "fds", "sockets", "rss_mb", "thread_kinds"} of a process (-1 where /proc cannot say)."""
    out = {"threads": -1, "fds": -1, "sockets": -1, "rss_mb": -1.0}
    base = f"/proc/{pid}"
    try:
        with open(f"{base}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    out["threads"] = int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    out["rss_mb"] = round(int(line.split()[1]) / 1024, 1)
        names = os.listdir(f"{base}/fd")
    except (OSError, ValueError):
        return out
    links = []
    for name in names:
        try:
            links.append(os.readlink(f"{base}/fd/{name}"))
        except OSError:  # closed meanwhile
            pass
    ring = min(1, links.count("anon_inode:[io_uring]"), links.count("anon_inode:[eventfd]"))
    sockets = sum(link.startswith("socket:") for link in links)
    out.update(fds=len(links) - 2 * ring, sockets=sockets, thread_kinds=_thread_kinds(base))
    return out


def _thread_kinds(base: str) -> dict[str, int]:
    """How many threads of each name (torch's native ones name themselves: pt_gloo_runloop, pt_tcpstore_uv):
    what grows, where something does."""
    kinds: dict[str, int] = {}
    try:
        tasks = os.listdir(f"{base}/task")
    except OSError:
        return kinds
    for task in tasks:
        try:
            with open(f"{base}/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        kinds[name] = kinds.get(name, 0) + 1
    return dict(sorted(kinds.items()))


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 256 * 1024
"""Blocks this large or larger get mappings of their own, given back to the system when freed."""


def steady_heap() -> bool:
    """Fix glibc's mmap threshold (MMAP_THRESHOLD) for this process. Left to itself, glibc raises the
    threshold to the size of every large block freed (up to 32 MiB), and blocks below it then come from the
    heap: a kept worker's rounds make and free such blocks in changing sizes (process groups, state bytes), and
    the heap's free space, which malloc_trim cannot hand back while live blocks sit between, grew by about
    50 MB per 100 rounds. A fixed threshold turns that off. A threshold set in the environment
    (MALLOC_MMAP_THRESHOLD_) is left as it is. True when set here."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(_glibc("mallopt", M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere). What a round
    freed stays in the allocator's arenas otherwise, so a kept worker's RSS would show its largest round,
    not what it holds."""
    _glibc("malloc_trim", 0)


def _glibc(name: str, *args: int) -> int:
    """glibc's allocator function `name` called with `args`; 0 where the C library is not glibc."""
    try:
        import ctypes

        return getattr(ctypes.CDLL("libc.so.6"), name)(*args)
    except (OSError, AttributeError):  # not glibc
        return 0
