"""Writing a file so that readers see the old content or the new, never half of it: the one helper
that checkpoints (state/), the summary (metrics.py), the data cache (data/) and etcd's secrets use.
And its mirror for readers, `read_regular`: a regular file of bounded size, or one line saying why not
(`open_regular` for a reader that bounds what it reads itself; `credential_problem`, the one rule for a
file holding a password, secret or key).

    python -c "from elastic_mnist.files import atomic_write; atomic_write('/tmp/x.json', '{}\\n')"
    python -c "from elastic_mnist.files import read_regular; read_regular('/dev/zero', 64, 'a key', 'use a file')"

The data goes to a fresh temporary file in the same directory (same filesystem, so the rename is
atomic), opened O_EXCL|O_NOFOLLOW so a planted file or symlink is never written through; it is fsynced,
renamed over the final name, and the directory is fsynced so the rename survives a power cut. On an
error the temporary file is removed and the final name is untouched.
"""

from __future__ import annotations

import errno
import os
import re
import stat
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
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{threading.get_ident()}-{random_suffix()}")
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


def random_suffix() -> str:
    return os.urandom(4).hex()


def sha256_of(path: str | os.PathLike) -> str:
    """The hex sha256 of a file's bytes, read in chunks."""
    import hashlib  # here: its OpenSSL start costs every stand-in (agent_link imports this module) ~5 ms of CPU

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


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


class RefusedFile(OSError):
    """A file a reader will not read (not a regular file, a symlink where none may be, over its cap).
    An OSError, so every reader that already survives an unreadable file survives this one; str() is one
    line naming the file, why and the fix (`why` alone: the reason, for a caller with its own wording)."""

    def __init__(self, what: str, path: str, why: str, fix: str, too_large: bool = False) -> None:
        super().__init__(f"{what} {path} {why}; {fix}")
        self.path, self.why = path, why
        self.too_large = too_large
        """Refused for its size alone (a reader with a cap that moves may read it another time)."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _open_regular(path: str, flags: int, what: str, fix: str, mode: int = 0o644) -> tuple[int, os.stat_result]:
    """(fd, its stat) of a regular file opened O_NONBLOCK (a FIFO or device never blocks the open); the
    fd is closed and RefusedFile raised for anything else, and for a symlink when flags hold O_NOFOLLOW."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as e:
        if e.errno == errno.ELOOP and flags & os.O_NOFOLLOW:
            raise RefusedFile(what, path, "is a symbolic link, which is not followed here", fix) from None
        if e.errno == errno.ENXIO:  # a socket, a FIFO opened for writing without a reader, a device without a driver
            raise RefusedFile(what, path, "is not a regular file (a socket, FIFO or device)", fix) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise RefusedFile(what, path, f"is {_kind(st.st_mode)}, not a regular file", fix)
    return fd, st


def open_regular(path: str | os.PathLike, what: str, fix: str,
                 follow_symlinks: bool = False) -> tuple[int, os.stat_result]:
    """(fd, its stat) of `path` opened for reading if it is a regular file, for a reader that bounds what it
    reads itself (the caller closes the fd); else RefusedFile, as read_regular. The fd blocks as usual."""
    path = os.fspath(path)
    fd, st = _open_regular(path, os.O_RDONLY | (0 if follow_symlinks else os.O_NOFOLLOW), what, fix)
    os.set_blocking(fd, True)
    return fd, st


def credential_problem(path: str, st: os.stat_result) -> tuple[str, str] | None:
    """(why, fix) when a credential file (a password, a secret, a private key) with this stat may not be
    trusted, else None. Its owner must be this user or root, and nobody else may change or read it. One
    exception, what a Kubernetes Secret volume holds: a file of root's that its group may also read, where
    that group is one of this process's own (the pod's fsGroup: kubelet adds group read to defaultMode)."""
    me, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    if st.st_uid not in (me, 0):
        return (f"belongs to uid {st.st_uid}, not to this user (uid {me}) or root",
                f"make it this user's and private: chown {me} {path}; chmod 600 {path}")
    ours_by_group = st.st_uid == 0 != me and st.st_gid in {os.getegid(), *os.getgroups()}
    if mode & 0o027 or (mode & 0o040 and not ours_by_group):
        return f"has mode {mode:04o}: others may read or change it", f"make it private: chmod 600 {path}"
    return None


def read_regular(path: str | os.PathLike, limit: int, what: str, fix: str, follow_symlinks: bool = False,
                 credential: bool = False, credential_fix: str = "") -> bytes:
    """The bytes of `path` if it is a regular file of at most `limit` bytes; else RefusedFile, worded
    "{what} {path} {why}; {fix}". Opened O_NONBLOCK, so a FIFO or device in its place is refused at
    once instead of blocking (or, like /dev/zero, never ending), and O_NOFOLLOW unless `follow_symlinks`
    (a path the operator named may be a symlink: Kubernetes projects a Secret's keys as symlinks into
    `..data/`, kubernetes pkg/volume/util/atomic_writer.go, AtomicWriter.createUserVisibleFiles).
    `credential`: also refused when credential_problem says so (a password, secret or key someone else could
    have planted, changed or read), with its fix or `credential_fix`. Other OSErrors (missing, no permission)
    pass through."""
    path = os.fspath(path)
    fd, st = _open_regular(path, os.O_RDONLY | (0 if follow_symlinks else os.O_NOFOLLOW), what, fix)
    try:
        problem = credential_problem(path, st) if credential else None
        if problem:
            raise RefusedFile(what, path, problem[0], credential_fix or problem[1])
        if st.st_size > limit:
            raise RefusedFile(what, path, f"is {st.st_size:,} bytes, over its cap of {limit:,}", fix, too_large=True)
        data = _read_at_most(fd, st.st_size, limit)
    finally:
        os.close(fd)
    if len(data) > limit:  # it grew while we read it
        raise RefusedFile(what, path, f"grew past its cap of {limit:,} bytes while read", fix, too_large=True)
    return data


def _read_at_most(fd: int, expected: int, limit: int) -> bytes:
    """Up to limit + 1 bytes: the size fstat gave in large reads, anything beyond it in small ones."""
    parts, total = [], 0
    while total <= limit:
        want = expected - total if total < expected else 1 << 20
        chunk = os.read(fd, min(want, limit + 1 - total, 1 << 30))
        if not chunk:
            break
        parts.append(chunk)
        total += len(chunk)
    return b"".join(parts)  # one part (the usual case) is returned as is, not copied


def open_append(path: str | os.PathLike, what: str, fix: str, mode: int = 0o644) -> int:
    """A file descriptor appending to the regular file `path` (created if missing), never through a symlink
    and never to a FIFO or device planted in its place (RefusedFile)."""
    path = os.fspath(path)
    fd, _ = _open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, what, fix, mode)
    os.set_blocking(fd, True)  # O_NONBLOCK only guarded the open; whoever gets the fd writes normally
    return fd


def _ancestors(path: str) -> list[str]:
    """Every directory above path, nearest first, as written and as the symlinks in it resolve."""
    found: list[str] = []
    for start in (os.path.abspath(path), os.path.realpath(path)):
        parent = os.path.dirname(start)
        while parent not in found:
            found.append(parent)
            if parent == os.path.dirname(parent):
                break
            parent = os.path.dirname(parent)
    return found


def open_ancestor(path: str) -> tuple[str, os.stat_result] | None:
    """The nearest existing directory above path through which another user could replace path, and its
    stat; None when there is none. Such a directory is one owned by another user than this one and root
    (its owner may rename anything in it, or chmod it so), or one others may write that is not sticky (a
    sticky one, like /tmp and /dev/shm, lets only an entry's owner rename or remove it)."""
    me = os.geteuid()
    for parent in _ancestors(path):
        try:
            st = os.stat(parent)
        except OSError:
            continue  # not there yet: whoever creates it is this process
        if st.st_uid not in (me, 0) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            return parent, st
    return None


def file_in_the_way(path: str | os.PathLike) -> str:
    """The path itself or its first existing ancestor, when that is not a directory; "" otherwise: a
    directory that can never be created there."""
    probe = os.path.abspath(path)
    while True:
        if os.path.lexists(probe):
            return "" if os.path.isdir(probe) else probe
        parent = os.path.dirname(probe)
        if parent == probe:
            return ""
        probe = parent
