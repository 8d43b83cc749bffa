"""This rank's in-memory snapshots as an optimization that never fails the job: a private directory, a
best-effort writer, a room check before each copy, and one report when snapshots must stop.

    python -m elastic_mnist.train --data-dir ../shared/data --snapshot-every 50    # under torchrun

A snapshot that cannot be written (no space, no permission, an I/O error), or would not fit in the space
left, turns snapshots off for this worker process with one warning naming the cause and the fix; training
goes on with durable checkpoints. The next worker start (a restart, a resize) tries again.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable

from elastic_mnist.metrics import Metrics
from elastic_mnist.state import snapshots
from elastic_mnist.state.format import path_for
from elastic_mnist.state.snapshots import SnapshotPlace
from elastic_mnist.state.writer import CheckpointWriter

# What a snapshot needs besides its own size: its temp file sits beside the two kept ones until the older
# is pruned, and tmpfs is shared with NCCL and everything else in /dev/shm.
_HEADROOM = 1.1
_SLACK_BYTES = 2**20


class Snapshotter:
    def __init__(self, snapshot_dir: str, place: SnapshotPlace, key: bytes | None, metrics: Metrics):
        self.place, self.metrics, self.writer = place, metrics, None
        self.readable = ""
        """Where this rank may read snapshots at restore ("" when the root was refused or snapshots are off)."""
        self.block_ms: list[float] = []
        self._fd: int | None = None
        if not place.directory:
            return
        refused = snapshots.claim_private(snapshots.root_of(snapshot_dir))
        if refused:
            self._off(refused)
            return
        try:
            self._fd = snapshots.hold(place.directory)
            snapshots.sweep_temps(place.directory)  # this rank's own directory: any temp is a dead writer's
        except OSError as e:
            self._off(f"cannot use {place.directory} ({e.strerror or e})")
            return
        self.readable = place.directory
        self.writer = CheckpointWriter(place.directory, keep=2, key=key, best_effort=True, warn=metrics.warn)

    def take(self, capture: Callable[[], dict], step: int, estimate: Callable[[], int]) -> None:
        """Snapshot the state `capture` returns, unless the last write failed or this one would not fit."""
        if self.writer is None:
            return
        failed = self.writer.failure
        reason = f"writing into {self.place.directory} failed: {failed}" if failed else self._no_room(estimate)
        if reason:
            self._off(reason)
            return
        t0 = time.perf_counter()
        self.writer.save(capture(), step)
        self.block_ms.append((time.perf_counter() - t0) * 1000)

    def keep(self, state: dict, step: int) -> str:
        """Snapshot `state` now and wait for it (the checkpoint volume cannot take it): its path, or "" when
        snapshots are off or the write failed."""
        if self.writer is None or self.writer.failure is not None:
            return ""
        self.writer.save(state, step, block=True)
        if self.writer.failure is not None or self.writer.held_step < step:
            return ""
        return path_for(self.place.directory, step)

    def _no_room(self, estimate: Callable[[], int]) -> str:
        need = (self.writer.last_size or estimate()) * _HEADROOM + _SLACK_BYTES
        free = shutil.disk_usage(self.place.directory).free
        if free >= need:
            return ""
        return (f"a snapshot needs about {need / 2**20:.1f} MiB and {self.place.directory} has "
                f"{free / 2**20:.1f} MiB free")

    def _off(self, reason: str) -> None:
        if self.writer is not None:
            self.writer.wait()
            self.writer = None
        self.metrics.warn(f"snapshots off on this worker: {reason}. Training goes on with durable checkpoints; "
                          "to keep snapshots give the snapshot directory more room (Kubernetes: the size of the "
                          "pod's /dev/shm, see docs/checkpoints.md) or pass --snapshot-every 0")
        self.metrics.event("snapshots_off", reason=reason)

    def close(self) -> None:
        """Wait for a write in flight, end the writer's thread and let go of the directory (safe to repeat)."""
        if self.writer is not None:
            self.writer.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove(self) -> None:
        """The job finished: free the memory."""
        self.close()
        snapshots.remove_own(self.place)
