"""In-memory snapshots: where each rank keeps them, and their lifetime.

    python -c "from elastic_mnist.state.snapshots import sweep; print(sweep('/dev/shm/elastic-mnist', keep_run=''))"

Layout: `{snapshot_dir}/{run id}/local{local rank}/ckpt-*.pt` on tmpfs (RAM that outlives the worker, not
the machine). Owners: a job that finishes removes its own run's directory; at every start a rank removes
other runs' directories that are older than --snapshot-max-age-h, then the oldest ones until the total
is under --snapshot-cap-mb. The current run's files are never swept by this (its writer keeps 2).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class SnapshotPlace:
    """This rank's snapshot directory and the origin stamped into its snapshots (dir empty: off)."""

    run_root: str
    """{snapshot_dir}/{run id}: everything this job keeps in memory on this node."""
    directory: str
    origin: dict


def place(snapshot_dir: str, run_id: str, local_rank: int, checkpoint_dir: str, enabled: bool) -> SnapshotPlace:
    origin = {"run_id": run_id, "checkpoint_dir": os.path.abspath(checkpoint_dir)}
    if not (enabled and snapshot_dir):
        return SnapshotPlace("", "", origin)
    safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
    run_root = os.path.join(snapshot_dir, safe_id)
    return SnapshotPlace(run_root, os.path.join(run_root, f"local{local_rank}"), origin)


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
