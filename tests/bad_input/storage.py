"""Rows of the bad-input table for what the machine, the pod or another user puts around the runtime's
storage: a pod's memory limit filled with page cache, a snapshot root whose parent another user may change.

    cd tests && python -m bad_input     # the whole table
"""

from __future__ import annotations

import os
from pathlib import Path

from bad_input.frame import Attempt, Ctx, Outcome, Row, Setup, warned

GIB = 1 << 30


def _own_checkpoint(place: Path) -> Path:
    """A 256 KiB state of this job at step 5, as an earlier process of it wrote it (this one knows no size)."""
    import torch

    from elastic_mnist.state import format as checkpoint

    state = {"step": 5, "weights": torch.zeros(1 << 16)}
    Path(checkpoint.path_for(str(place), 5)).write_bytes(checkpoint.encode(state))
    return place / "ckpt-000000005.pt"


def _cgroup(where: Path, current: int, cache: int) -> str:
    """A cgroup v2 tree as a pod's: memory.max 4 GiB, memory.current, and `cache` of it page cache."""
    where.mkdir(exist_ok=True)
    (where / "memory.max").write_text(f"{4 * GIB}\n")
    (where / "memory.current").write_text(f"{current}\n")
    (where / "memory.stat").write_text(f"anon {current - cache}\nfile {cache}\nactive_file {cache // 3}\n"
                                       f"inactive_file {cache - cache // 3}\nshmem 0\n")
    return str(where)


def _in_pod(cache: int) -> Attempt:
    """This process in a pod at 64 KiB under its limit, `cache` of its usage page cache: it restores, then
    saves step 10 (the save reads its file back and prunes the directory)."""
    def attempt(target: Path, ctx: Ctx) -> Outcome:
        import torch

        from elastic_mnist.state import format as checkpoint
        from elastic_mnist.state.writer import CORRUPT_DIR, CheckpointWriter

        ctx.monkeypatch.setattr(checkpoint, "CGROUP", _cgroup(target.parent.parent / "cgroup", 4 * GIB - 65536,
                                                              cache))
        ctx.monkeypatch.setattr(checkpoint, "_known_sizes", {})  # a fresh process: no size known yet

        def restore_and_save(warn):
            found = checkpoint.load_latest(str(target.parent), warn)
            writer = CheckpointWriter(str(target.parent), keep=3, warn=warn)
            writer.save({"step": 10, "weights": torch.ones(1 << 16)}, 10, block=True)
            return found, writer.last_path, os.path.isdir(target.parent / CORRUPT_DIR)
        outcome = warned(ctx, restore_and_save,
                         lambda r: r[1].endswith("ckpt-000000010.pt") and not r[2]
                         and (r[0] is None) == (cache == 0) and (r[0] is None or r[0][0]["step"] == 5))
        os.unlink(checkpoint.path_for(str(target.parent), 10))  # the sentinels' directory as it was
        return outcome
    return attempt


def _parent_of_another_user(sticky: bool) -> Setup:
    """A snapshot root under a directory of uid 65534 that others may write (sticky or not)."""
    def setup(place: Path) -> Path:
        parent = place / "theirs"
        parent.mkdir()
        os.chown(parent, 65534, 65534)
        parent.chmod(0o1777 if sticky else 0o777)
        return parent
    return setup


def _group_writable_parent(place: Path) -> Path:
    parent = place / "ours"
    parent.mkdir()
    parent.chmod(0o775)
    return parent


def _snapshots_under(target: Path, ctx: Ctx) -> Outcome:
    """A worker's snapshots in `target`/shm: refused with one line before anything is created there."""
    from elastic_mnist.metrics import Metrics
    from elastic_mnist.state import snapshots
    from elastic_mnist.state.snapshotter import Snapshotter

    def attempt(_warn):
        root = str(target / "shm")
        taker = Snapshotter(root, snapshots.place(root, "job", 0, str(target / "ckpt"), True), None, Metrics(0, ""))
        return taker.readable, os.path.lexists(root)
    return warned(ctx, attempt, lambda found: found == ("", False))


STORAGE = [
    Row("`--checkpoint-dir` (in a pod)", "`memory.max` 4 GiB, `memory.current` 64 KiB under it, most of it page cache",
        "none: the page cache is not counted against the read cap, which is at least 8x a state the process "
        "wrote or verified", "the job's step 5, resumed; its save of step 10 verifies; nothing moved", "goes on",
        _own_checkpoint, _in_pod(cache=3 * GIB)),
    Row("`--checkpoint-dir` (in a pod)", "the same pod with its memory held by the process, no page cache",
        "warning: skipping checkpoint …ckpt-000000005.pt: is 263,… bytes, over its cap of …; too large to read "
        "here now, which does not make it corrupt: it is left where it is, unread",
        "the file, where it was (never moved to `corrupt/`); the save of step 10 verifies", "goes on",
        _own_checkpoint, _in_pod(cache=0)),
    Row("`--snapshot-dir`", "under a directory of another user that all may write (mode 0777), root only",
        "snapshots off on this worker: …/theirs, a parent of the snapshot root …/shm, belongs to uid 65534 with "
        "mode 777: that user could replace the root (read or plant snapshots); pass a --snapshot-dir whose "
        "parents are yours or root's, or sticky like /tmp and /dev/shm",
        "the parent: nothing created in it", "goes on", _parent_of_another_user(sticky=False), _snapshots_under,
        needs="root"),
    Row("`--snapshot-dir`", "under a sticky directory (mode 1777) of another user, root only",
        "snapshots off on this worker: …/theirs, a parent of the snapshot root …/shm, belongs to uid 65534 with "
        "mode 1777", "the parent: nothing created in it", "goes on", _parent_of_another_user(sticky=True),
        _snapshots_under, needs="root"),
    Row("`--snapshot-dir`", "under a directory of this user that its group may write (mode 0775)",
        "snapshots off on this worker: …/ours, a parent of the snapshot root …/shm, is writable by others "
        "(mode 775) and not sticky", "the parent: nothing created in it", "goes on", _group_writable_parent,
        _snapshots_under),
]
