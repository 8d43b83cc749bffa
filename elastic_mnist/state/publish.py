"""Publishing a finished file under its final name without replacing one another writer completed,
on any filesystem a checkpoint directory may live on (used by elastic_mnist.state.format.write_durable).

    python -c "from elastic_mnist.state.publish import method_of; print(method_of('checkpoints'))"

Each directory is probed once and gets the strongest method it supports:
  link       os.link (any POSIX disk, NFS): atomic, never clobbers.
  noreplace  renameat2(RENAME_NOREPLACE) (ext4, xfs, btrfs, tmpfs, FUSE that implements it): atomic,
             never clobbers.
  claim      exclusive create of `.NAME.claim`, then rename (SMB/Azure Files, FUSE without hard
             links): never clobbers as far as the server makes O_CREAT|O_EXCL atomic (SMB 2/3 and
             NFS v3+ do; object-store FUSE mounts may not).
In every case the data is fsynced under a temporary name first (elastic_mnist.files.write_temp) and
readers verify checksums, so a half-written file is never used as the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import threading
import time

from elastic_mnist.files import UNSUPPORTED


def method_of(directory: str) -> str:
    """The publish method probed for directory ("link" until a probe said otherwise)."""
    return _PUBLISH_METHODS.get(os.path.realpath(directory), "link")


# How a finished temp file becomes the final name without replacing an existing one, per directory
# (probed once): "link" (hard link; any POSIX disk, NFS), "noreplace" (renameat2 RENAME_NOREPLACE;
# local filesystems and FUSE implementations that support it), "claim" (an exclusive-create claim
# file, then rename: SMB/Azure Files and FUSE without hard links; no-clobber holds as far as the
# server makes O_EXCL atomic). Readers verify checksums, so even a non-atomic rename never yields a
# half-written checkpoint that is used.
_PUBLISH_METHODS: dict[str, str] = {}
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_STALE_CLAIM_S = 120.0  # a claim is held for one exists-check and one rename: milliseconds


def publish(tmp: str, path: str, replace: bool) -> bool:
    if replace:
        os.replace(tmp, path)
        return True
    directory = os.path.realpath(os.path.dirname(path) or ".")
    while True:
        method = _publish_method(directory, tmp)
        try:
            return {"link": _publish_link, "noreplace": _publish_noreplace, "claim": _publish_claim}[method](tmp, path)
        except OSError as e:
            if e.errno not in UNSUPPORTED or method == "claim":
                raise
            _PUBLISH_METHODS[directory] = _next_method(method)  # the probe was optimistic; step down


def _next_method(method: str) -> str:
    return "noreplace" if method == "link" and _renameat2() is not None else "claim"


def _publish_method(directory: str, tmp: str) -> str:
    """The directory's publish method, probed once with real files next to tmp."""
    method = _PUBLISH_METHODS.get(directory)
    if method is None:
        probe = f"{tmp}.probe"
        try:
            os.link(tmp, probe)
            os.unlink(probe)
            method = "link"
        except OSError as e:
            if e.errno not in UNSUPPORTED:
                raise
            method = _next_method("link")
        _PUBLISH_METHODS[directory] = method
    return method


def _publish_link(tmp: str, path: str) -> bool:
    try:
        os.link(tmp, path)  # unlike os.replace, never clobbers a file another writer completed
    except FileExistsError:
        return False
    return True


def _renameat2():
    fn = getattr(_libc(), "renameat2", None) if _libc() is not None else None
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _publish_noreplace(tmp: str, path: str) -> bool:
    fn = _renameat2()
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if fn(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(path), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        return False
    raise OSError(err, os.strerror(err), path)


def _publish_claim(tmp: str, path: str) -> bool:
    """Exclusive-create a claim beside the final name; only its holder may rename into a free name."""
    claim = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.claim")
    for _ in range(2):
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            if not _drop_stale_claim(claim):
                return False  # another writer is publishing this name right now
            continue
        try:
            if os.path.lexists(path):
                return False
            os.rename(tmp, path)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):  # moved aside by a writer judging it stale (_break_claim)
                os.unlink(claim)
    return False


def _drop_stale_claim(claim: str) -> bool:
    """A claim left by a writer that died between claiming and renaming: move it out of the way. True when
    the name may be claimed again (whoever wins the exclusive create publishes), False while it is held."""
    try:
        st = os.stat(claim)
    except FileNotFoundError:
        return True
    if time.time() - st.st_mtime < _STALE_CLAIM_S:
        return False
    return _break_claim(claim, _identity(st))


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    # The inode number alone is not enough: a claim made right after the stale one was unlinked often
    # gets the same number. Its mtime (which a rename keeps) tells them apart.
    return st.st_dev, st.st_ino, st.st_mtime_ns


def _break_claim(claim: str, stale: tuple[int, int, int]) -> bool:
    """Remove the claim file whose _identity was judged stale, never a live one.

    Unlinking by name after a stat is racy: two writers judge the same claim stale, the first removes it
    and claims the name anew, the second then unlinks that live claim and both publish. A rename of one
    file succeeds once; the file renamed aside is then checked to be the stale one. If a live claim was
    taken instead (the other writer's, made after the stale one was gone), the name is claimed again at
    once with an exclusive create (never clobbering a claim a third writer may have made meanwhile)."""
    aside = f"{claim}.stale-{os.getpid()}-{threading.get_ident()}-{os.urandom(4).hex()}"
    try:
        os.rename(claim, aside)
    except FileNotFoundError:
        return True  # another writer moved it first; the exclusive create decides who goes on
    if _identity(os.stat(aside)) == stale:
        os.unlink(aside)
        return True
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))  # held for its owner
    except FileExistsError:
        pass  # claimed by someone else meanwhile: held either way
    os.unlink(aside)
    return False
