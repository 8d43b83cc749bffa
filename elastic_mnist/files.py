"""Writing a file so that readers see the old content or the new, never half of it: the one helper
that checkpoints (state/), the summary (metrics.py), the data cache (data/) and etcd's secrets use.

    python -c "from elastic_mnist.files import atomic_write; atomic_write('/tmp/x.json', '{}\\n')"

The data goes to a fresh temporary file in the same directory (same filesystem, so the rename is
atomic), opened O_EXCL|O_NOFOLLOW so a planted file or symlink is never written through; it is fsynced,
renamed over the final name, and the directory is fsynced so the rename survives a power cut. On an
error the temporary file is removed and the final name is untouched.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import threading
from collections.abc import Iterable

Chunk = bytes | bytearray | memoryview
Data = Chunk | str | Iterable[Chunk]  # text is UTF-8 encoded; an iterable is written chunk by chunk
# Errors by which a filesystem says "not supported here" (some FUSE filesystems answer EIO).
UNSUPPORTED = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EIO, errno.ENOSYS, errno.EMLINK,
               errno.EINVAL, errno.EXDEV}


# What write_temp names a temp file: hidden, the final name, then pid, thread id and a random part. Only
# names of this form are ever swept as a dead writer's leftovers.
TEMP_NAME = re.compile(r"^\.[^/]+\.tmp-\d+-\d+-[0-9a-f]{8}$")


def _chunks(data: Data) -> Iterable[Chunk]:
    if isinstance(data, str):
        return [data.encode()]
    return [data] if isinstance(data, (bytes, bytearray, memoryview)) else data


def write_temp(directory: str, name: str, data: Data, mode: int = 0o644) -> str:
    """data, fsynced, under a new hidden name next to `name` in directory; the caller publishes it.
    The random part keeps a temp file a crashed writer (same pid, same thread id) left from blocking us."""
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        os.fchmod(fd, mode)  # the umask must not narrow it: a shared data dir's cache is read by others
        with os.fdopen(fd, "wb") as f:
            for chunk in _chunks(data):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def fsync_dir(directory: str) -> None:
    """Make a rename or link in directory durable; a no-op where the filesystem cannot do it."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some network filesystems do not open directories; their renames are server-side
    try:
        os.fsync(dir_fd)
    except OSError as e:
        if e.errno not in UNSUPPORTED:
            raise
    finally:
        os.close(dir_fd)


def write_then(path: str | os.PathLike, data: Data, mode: int, publish) -> bool:
    """write_temp next to path, then publish(tmp, path) (True: published); the temp file never stays."""
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    tmp = write_temp(directory, os.path.basename(path), data, mode)
    try:
        published = publish(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    if published:
        fsync_dir(directory)
    return published


def _replace(tmp: str, path: str) -> bool:
    os.replace(tmp, path)
    return True


def _link_if_free(tmp: str, path: str) -> bool:
    try:
        os.link(tmp, path)  # unlike a rename, fails on an existing name
    except FileExistsError:
        return False
    return True


def atomic_write(path: str | os.PathLike, data: Data, mode: int = 0o644) -> None:
    """Replace path's content with data (bytes, text, or an iterable of byte chunks) in one step."""
    write_then(path, data, mode, _replace)


def atomic_create(path: str | os.PathLike, data: Data, mode: int = 0o644) -> bool:
    """Like atomic_write, but never replaces an existing file: False (and nothing written) if path exists.
    A hard link publishes the complete temp file under the final name only if that name is free."""
    return write_then(path, data, mode, _link_if_free)
