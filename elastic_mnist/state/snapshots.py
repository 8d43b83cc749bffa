"""In-memory snapshots: where each rank keeps them, who may use the directory, and their lifetime.

    python -c "from elastic_mnist.state.snapshots import sweep; print(sweep('/dev/shm/elastic-mnist-0', keep_run=''))"

Layout: `{snapshot_dir}/{run name}/local{local rank}/ckpt-*.pt` on tmpfs (RAM that outlives the worker, not
the machine). `{uid}` in --snapshot-dir is the user's id. The root is the runtime's own: created 0700 and
marked (ROOT_MARK) by the first worker, or an existing empty private directory of this user, marked then.
Anything else (another user's directory, one others may write, a non-empty directory without the mark, such
as a home directory passed by mistake) is refused and left exactly as it was: the worker trains on
without snapshots. A run name is the run id made safe (a readable prefix and a hash of the whole id): it
cannot leave the root and two ids never share one; its directory is marked too (RUN_MARK). Owners: a job
that finishes removes its own run's directory; at every start a rank removes other runs' directories that
are older than --snapshot-max-age-h, then the oldest ones until the total is under --snapshot-cap-mb, but
only directories it can prove are runs of this package (the name's form and the mark, under a marked root)
and never one a live worker holds (each worker holds a lock in its directory while it runs; the kernel drops
it when the process dies).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass

from elastic_mnist import files

LIVE_FILE = ".live"
ROOT_MARK = ".elastic-mnist-snapshots"  # in a snapshot root the runtime created or adopted (never one it did not)
RUN_MARK = ".elastic-mnist-run"  # in each run directory it created: the sweep removes nothing else
_RUN_NAME = re.compile(r"^[A-Za-z0-9_-]{1,40}-[0-9a-f]{12}$")  # what run_name() makes
_LOCAL = re.compile(r"^local\d+$")


@dataclass(frozen=True)
class SnapshotPlace:
    """This rank's snapshot directory and the origin stamped into its snapshots (dir empty: off)."""

    run_root: str
    """{snapshot_dir}/{run id}: everything this job keeps in memory on this node."""
    directory: str
    origin: dict


def root_of(snapshot_dir: str) -> str:
    """--snapshot-dir with `{uid}` filled in."""
    return snapshot_dir.replace("{uid}", str(os.geteuid()))


def run_name(run_id: str) -> str:
    """A directory name for a run id that cannot escape its parent ('..', '/') or collide ('a/b', 'a_b')."""
    prefix = re.sub(r"[^A-Za-z0-9_-]+", "_", run_id).strip("_-")[:40] or "run"
    return f"{prefix}-{hashlib.sha256(run_id.encode()).hexdigest()[:12]}"


def place(snapshot_dir: str, run_id: str, local_rank: int, checkpoint_dir: str, enabled: bool) -> SnapshotPlace:
    origin = {"run_id": run_id, "checkpoint_dir": os.path.abspath(checkpoint_dir)}
    if not (enabled and snapshot_dir):
        return SnapshotPlace("", "", origin)
    run_root = os.path.join(root_of(snapshot_dir), run_name(run_id))
    return SnapshotPlace(run_root, os.path.join(run_root, f"local{local_rank}"), origin)


def claim_private(root: str) -> str | None:
    """Make root this runtime's snapshot root, or say why not (one line, with the fix); None when it may be
    used. Created here: 0700 and marked. Found: used only if it is ours (marked, or an empty or earlier
    version's root, marked now), this user's and private. A refused directory is not changed at all."""
    try:
        unsafe = _unsafe_parent(root)
        if unsafe:
            return unsafe
        os.makedirs(os.path.dirname(root) or ".", exist_ok=True)
        unsafe = _unsafe_parent(root)  # the parents it made follow the umask
        if unsafe:
            return unsafe
        try:
            os.mkdir(root, 0o700)
            _mark(root, ROOT_MARK)
            return None
        except FileExistsError:
            pass
        st = os.lstat(root)
    except OSError as e:
        return f"cannot create {root} ({e.strerror or e}); pass a --snapshot-dir you may write, or --snapshot-every 0"
    if not stat.S_ISDIR(st.st_mode):
        return f"{root} is not a directory (a symlink or file in its place); remove it or pass another --snapshot-dir"
    return _refusal(root, st) or _adopt(root, stat.S_IMODE(st.st_mode))


def _unsafe_parent(root: str) -> str | None:
    """A root is private only if no other user can swap it: every directory above it must be this user's or
    root's, and writable by nobody else unless sticky (files.open_ancestor)."""
    found = files.open_ancestor(root)
    if found is None:
        return None
    parent, st = found
    mode = stat.S_IMODE(st.st_mode)
    why = (f"belongs to uid {st.st_uid} with mode {mode:o}: that user" if st.st_uid not in (os.geteuid(), 0) else
           f"is writable by others (mode {mode:o}) and not sticky: another user")
    return (f"{parent}, a parent of the snapshot root {root}, {why} could replace the root (read or plant "
            "snapshots); pass a --snapshot-dir whose parents are yours or root's, or sticky like /tmp and /dev/shm")


def _refusal(root: str, st: os.stat_result) -> str | None:
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        return (f"{root} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}); pass a --snapshot-dir "
                "of your own (the default, /dev/shm/elastic-mnist-{uid}, is per user)")
    if mode & 0o022:
        return (f"{root} is writable by others (mode {mode:o}): its files could be planted; pass a new "
                "--snapshot-dir (the runtime creates it 0700)")
    return None


def _adopt(root: str, mode: int) -> str | None:
    if _has_mark(root, ROOT_MARK):
        return None
    names = os.listdir(root)
    if names and not all(_legacy_run(os.path.join(root, n)) for n in names):
        return (f"{root} already holds files this runtime did not write ({len(names)} entries, e.g. "
                f"{sorted(names)[0]!r}); the runtime never changes or sweeps a directory it did not create: pass "
                "a new --snapshot-dir (it is created 0700), or --snapshot-every 0")
    if mode & 0o077:
        return (f"{root} is readable by others (mode {mode:o}) and was not created by this runtime, which "
                "never changes its mode: pass a new --snapshot-dir (it is created 0700)")
    _mark(root, ROOT_MARK)
    return None


def _mark(directory: str, name: str) -> None:
    fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)


def _has_mark(directory: str, name: str) -> bool:
    try:
        st = os.lstat(os.path.join(directory, name))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _legacy_run(path: str) -> bool:
    """A run directory written before run directories were marked: its name's form, only local<N> dirs."""
    try:
        return (_RUN_NAME.match(os.path.basename(path)) is not None and not os.path.islink(path)
                and all(_LOCAL.match(n) for n in os.listdir(path)))
    except OSError:
        return False


def is_run_dir(path: str) -> bool:
    """Provably a run directory of this package: the form run_name() gives, and its mark (or the legacy form)."""
    if os.path.islink(path) or not os.path.isdir(path) or not _RUN_NAME.match(os.path.basename(path)):
        return False
    return _has_mark(path, RUN_MARK) or _legacy_run(path)


def hold(directory: str) -> int:
    """Mark directory as in use by this process (released by the kernel when the process ends); its run
    directory (the parent) is marked as this package's on the way."""
    run_root = os.path.dirname(directory)
    os.makedirs(run_root, 0o700, exist_ok=True)
    if not _has_mark(run_root, RUN_MARK):
        _mark(run_root, RUN_MARK)
    os.makedirs(directory, 0o700, exist_ok=True)
    fd = os.open(os.path.join(directory, LIVE_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _is_live(run_root: str) -> bool:
    for name in os.listdir(run_root):
        if not _LOCAL.match(name):
            continue
        try:
            fd = os.open(os.path.join(run_root, name, LIVE_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops the probe's own lock
    return False


def sweep_temps(directory: str, min_age_s: float = 0.0) -> list[str]:
    """Remove temp files a killed writer left at least min_age_s old: only names of files.write_temp's form
    (`.NAME.tmp-PID-THREAD-HEX`), never another program's."""
    removed, now = [], time.time()
    try:
        names = [n for n in os.listdir(directory) if files.TEMP_NAME.match(n)]
    except OSError:  # not there (yet), or not a directory: whoever uses it reports that, with the fix
        return []
    for name in names:
        path = os.path.join(directory, name)
        try:
            if now - os.lstat(path).st_mtime >= min_age_s:
                os.unlink(path)
                removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _usage(path: str) -> tuple[float, int]:
    """(newest modification time, total bytes) of a run's directory tree."""
    newest, total = os.path.getmtime(path), 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:  # its own writer pruned it meanwhile
                continue
            newest, total = max(newest, st.st_mtime), total + st.st_size
    return newest, total


def sweep(snapshot_dir: str, keep_run: str, max_age_s: float = 6 * 3600, cap_bytes: int = 0) -> list[str]:
    """Remove other runs' snapshots that are too old, then the oldest until under cap_bytes (0: no cap).
    keep_run is this job's run root (never removed here). Returns the removed directories."""
    if not _has_mark(snapshot_dir, ROOT_MARK):
        return []  # not a root this runtime owns: nothing in it is ours to remove
    runs = []
    for name in os.listdir(snapshot_dir):
        path = os.path.join(snapshot_dir, name)
        if is_run_dir(path) and os.path.abspath(path) != os.path.abspath(keep_run or "/nonexistent"):
            try:
                if _is_live(path):
                    continue
                runs.append((path, *_usage(path)))
            except FileNotFoundError:  # another rank swept it first
                continue
    now, removed = time.time(), []
    total = sum(size for _, _, size in runs) + (_usage(keep_run)[1] if keep_run and os.path.isdir(keep_run) else 0)
    for path, newest, size in sorted(runs, key=lambda r: r[1]):  # oldest first
        if now - newest > max_age_s or (cap_bytes and total > cap_bytes):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            total -= size
    return removed


def remove_own(snapshot: SnapshotPlace) -> None:
    """A finished job's snapshots are of no use to anyone: free the memory now. Safe to repeat; the
    run root goes once every local rank has removed its own directory."""
    if not snapshot.directory:
        return
    shutil.rmtree(snapshot.directory, ignore_errors=True)
    try:
        if not any(_LOCAL.match(n) for n in os.listdir(snapshot.run_root)):
            os.unlink(os.path.join(snapshot.run_root, RUN_MARK))
            os.rmdir(snapshot.run_root)
    except OSError:  # other local ranks still finishing, or already gone
        pass


def remove_root_if_unused(root: str) -> bool:
    """Remove a snapshot root that holds nothing but its mark (its owner's last run is over)."""
    try:
        if os.listdir(root) == [ROOT_MARK] and _has_mark(root, ROOT_MARK):
            os.unlink(os.path.join(root, ROOT_MARK))
            os.rmdir(root)
            return True
    except OSError:
        pass
    return False
