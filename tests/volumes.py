"""A real tmpfs of a given size (what a full /dev/shm, log or checkpoint volume is), mounted for one test and
always unmounted; and the ways a test makes it full, read-only, or gives the room back."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess

import pytest

from elastic_mnist import volume


@contextlib.contextmanager
def tiny_tmpfs(path, size_kib: int):
    """Mount a size_kib tmpfs at path (needs root, as CI runs; elsewhere the test is skipped, saying so)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        volume.forget()  # the next tmpfs may get this one's device number


def fill(mount, leave_pages: int = 0) -> str:
    """Fill the volume at mount with one file until it refuses more, then give back `leave_pages` 4 KiB
    pages; the filler's path (remove it to give the room back)."""
    spare = os.path.join(mount, "spare")
    with open(spare, "wb") as f:
        f.write(b"s" * 4096 * leave_pages)
    filler = os.path.join(mount, "filler")
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    os.unlink(spare)
    return filler


def remount(mount, read_only: bool) -> None:
    subprocess.run(["mount", "-o", f"remount,{'ro' if read_only else 'rw'}", str(mount)], check=True)
