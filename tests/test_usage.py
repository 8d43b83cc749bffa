"""What a kept worker journals at each round's end (usage.py): counts that a round which frees what it made
leaves where they were.

    python -m pytest -q tests/test_usage.py
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

from torch.distributed import TCPStore

from elastic_mnist.usage import usage


def _links() -> list[str]:
    fds = [f"/proc/self/fd/{n}" for n in os.listdir("/proc/self/fd")]
    return [os.readlink(fd) for fd in fds if os.path.exists(fd)]


def test_hosting_a_rounds_store_again_and_again_leaves_the_counts_where_the_first_left_them():
    def host_a_round() -> None:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
        store.set("round", b"1")
        assert store.get("round") == b"1"
        del store
        gc.collect()

    host_a_round()  # what libuv makes once a process (a pipe; an io_uring ring where the kernel has one) stays
    first = usage()
    for _ in range(3):
        host_a_round()
    again = usage()
    # the counts are the whole pytest process's: an earlier test's thread or socket may end meanwhile (a loaded
    # machine makes that likelier); a leak is what grows
    grown = {k: again[k] - first[k] for k in ("fds", "sockets", "threads") if again[k] > first[k]}
    assert not grown, (grown, first, again, _links())
    assert _links().count("anon_inode:[io_uring]") <= 1, _links()  # one ring a process, however many rounds


_HEAP_PROBE = r"""
import ctypes, sys
from elastic_mnist.usage import steady_heap

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype, libc.malloc.restype, libc.free.argtypes = Info, ctypes.c_void_p, [ctypes.c_void_p]
if sys.argv[1] == "steady":
    assert steady_heap()
libc.free(libc.malloc(8 << 20))  # a large block freed: glibc, left alone, raises its threshold to its size
before = libc.mallinfo2().hblkhd
block = libc.malloc(4 << 20)
print(libc.mallinfo2().hblkhd - before)
libc.free(block)
"""


def test_a_steady_heap_gives_every_large_block_a_mapping_of_its_own():
    """glibc's own threshold follows the blocks freed, so that a 4 MiB block after a freed 8 MiB one comes from
    the heap, where what a kept worker frees piles up; a steady heap maps it, and gives it back when freed."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    mapped = {how: int(subprocess.run([sys.executable, "-c", _HEAP_PROBE, how], env=env, check=True,
                                      capture_output=True, text=True).stdout) for how in ("steady", "left")}
    assert mapped["steady"] >= 4 << 20 and mapped["left"] == 0, mapped
