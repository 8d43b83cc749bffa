"""A real tmpfs of a given size (what a full /dev/shm is), mounted for one test and always unmounted."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest


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
