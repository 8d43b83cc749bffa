"""In-memory snapshots: where each rank keeps them, who may use the directory, and their lifetime.

    python -c "from elastic_mnist.state.snapshots import sweep; print(sweep('/dev/shm/elastic-mnist-0', keep_run=''))"

Layout: `{snapshot_dir}/{run name}/local{local rank}/ckpt-*.pt` on tmpfs (RAM that outlives the worker, not
the machine). `{uid}` in --snapshot-dir is the user's id: the default root is private to its user, created
0700, and a root owned by someone else or writable by others is refused (what is in it could be planted,
and what we write could be read). A run name is the run id made safe (a readable prefix and a hash of the
whole id): it cannot leave the root and two ids never share one. Owners: a job that finishes removes its
own run's directory; at every start a rank removes other runs' directories that are older than
--snapshot-max-age-h, then the oldest ones until the total is under --snapshot-cap-mb, but never one a
live worker holds (each worker holds a lock in its directory while it runs; the kernel drops it when the
process dies).
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

LIVE_FILE = ".live"


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
    """Create root 0700 (or check an existing one is ours and not writable by others); None when it may
    be used, else why not (one line, with the fix)."""
    try:
        os.makedirs(os.path.dirname(root) or ".", exist_ok=True)
        try:
            os.mkdir(root, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(root)
    except OSError as e:
        return f"cannot create {root} ({e.strerror or e}); pass a --snapshot-dir you may write, or --snapshot-every 0"
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        return f"{root} is not a directory (a symlink or file in its place); remove it or pass another --snapshot-dir"
    if st.st_uid != os.geteuid():
        return (f"{root} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}); pass a --snapshot-dir "
                "of your own (the default, /dev/shm/elastic-mnist-{uid}, is per user)")
    if mode & 0o022:
        return (f"{root} is writable by others (mode {mode:o}): its files could be planted; remove it (the next "
                "run creates it 0700) or pass another --snapshot-dir")
    if mode & 0o077:
        os.chmod(root, 0o700)  # ours, and nobody could write it: only close it for reading
    return None


def hold(directory: str) -> int:
    """Mark directory as in use by this process (released by the kernel when the process ends)."""
    os.makedirs(directory, 0o700, exist_ok=True)
    fd = os.open(os.path.join(directory, LIVE_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _is_live(run_root: str) -> bool:
    for name in os.listdir(run_root):
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
    """Remove temp files a killed writer left (`.NAME.tmp-…`) at least min_age_s old."""
    removed, now = [], time.time()
    try:
        names = [n for n in os.listdir(directory) if n.startswith(".") and ".tmp-" in n]
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
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:  # its own writer pruned it meanwhile
                continue
            newest, total = max(newest, st.st_mtime), total + st.st_size
    return newest, total


def sweep(snapshot_dir: str, keep_run: str, max_age_s: float = 6 * 3600, cap_bytes: int = 0) -> list[str]:
    """Remove other runs' snapshots that are too old, then the oldest until under cap_bytes (0: no cap).
    keep_run is this job's run root (never removed here). Returns the removed directories."""
    try:
        names = os.listdir(snapshot_dir)
    except FileNotFoundError:
        return []
    runs = []
    for name in names:
        path = os.path.join(snapshot_dir, name)
        if os.path.isdir(path) and os.path.abspath(path) != os.path.abspath(keep_run or "/nonexistent"):
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
        os.rmdir(snapshot.run_root)
    except OSError:  # other local ranks still finishing, or already gone
        pass
