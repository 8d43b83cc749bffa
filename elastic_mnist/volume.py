"""A log or checkpoint volume that fills up or turns read-only while a job trains: one warning per volume,
training goes on, and writing resumes by itself (one line) once the volume has room again.

    python -c "from elastic_mnist import volume; print(volume.of('runs').ready())"

Only a full, over-quota, read-only or failing volume is taken so (ENOSPC, EDQUOT, EROFS, EIO): every other
error of a write is raised as before. What cannot be written meanwhile is skipped, never half-written: a
journal line, a TensorBoard record, a checkpoint. The training state is not lost: it stays in the workers'
memory, in their in-memory snapshots and with their peers, and the next checkpoint written holds it.
Volumes are told apart by device: a log dir and a checkpoint dir on one full disk give one warning.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable

ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})
_RETRY_ROOM = 1 << 16  # free bytes a volume needs before a skipped write is tried again (a journal line)


def room_error(error: BaseException | None) -> OSError | None:
    """The OSError of a full, over-quota, read-only or failing volume behind error (or its causes), else None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in ROOM_ERRNOS:
            return error
        error = error.__cause__ or error.__context__
    return None


class Volume:
    """The writes of this process into one volume: whether to try one now, and the one warning and the one
    line of relief that a full stretch gets."""

    def __init__(self) -> None:
        self.down: OSError | None = None
        self.where = ""
        self.skipped = 0
        self._lock = threading.Lock()

    def ready(self, need: int = 0) -> bool:
        """Whether to try a write of about `need` bytes: always while writes succeed; after a failure, once the
        volume shows that much room (and 64 KiB) and is writable again. A skipped write is counted."""
        with self._lock:
            if self.down is None:
                return True
            try:
                st = os.statvfs(self.where)
            except OSError:
                st = None
            if st is not None and not st.f_flag & os.ST_RDONLY and st.f_bavail * st.f_frsize >= need + _RETRY_ROOM:
                return True
            self.skipped += 1
            return False

    def failed(self, what: str, error: OSError, warn: Callable[[str], None]) -> None:
        """A write of `what` into directory failed for lack of room: the first of a stretch warns, once."""
        with self._lock:
            first, self.down = self.down is None, error
            self.skipped += 1
        if first:
            warn(f"warning: cannot write {what}: {error.strerror or error} ({errno.errorcode.get(error.errno, '?')}); "
                 "training goes on, the state kept in memory (this process, its snapshots and its peers), and what "
                 f"cannot be written meanwhile is skipped. Writing resumes by itself once the volume of {self.where} "
                 "has room again: free space there, or make it writable")

    def written(self, warn: Callable[[str], None]) -> None:
        """A write succeeded: after a stretch of failures, say once that writing resumed."""
        with self._lock:
            if self.down is None:
                return
            skipped, self.down, self.skipped = self.skipped, None, 0
        warn(f"writing into the volume of {self.where} resumed ({skipped} write(s) skipped while it could not be "
             "written)")


_volumes: dict[int, Volume] = {}
_volumes_lock = threading.Lock()


def of(directory: str) -> Volume:
    """The Volume holding directory (its nearest existing ancestor's device), one per device in this process."""
    path = os.path.abspath(directory)
    while True:
        try:
            device = os.stat(path).st_dev
            break
        except OSError:
            if path == os.path.dirname(path):
                device = -1
                break
            path = os.path.dirname(path)
    with _volumes_lock:
        found = _volumes.setdefault(device, Volume())
        if not found.where or found.down is None:
            found.where = path  # where statvfs looks, and what the lines name
        return found


def forget() -> None:
    """Drop what this process knows of its volumes (a test that unmounts one and mounts another)."""
    with _volumes_lock:
        _volumes.clear()
