"""In-memory snapshots have an owner and a lifetime: a finished job removes its own, a start removes
other runs' stale ones and keeps the total under a cap (oldest first)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from conftest import REPO

from elastic_mnist import procs
from elastic_mnist.config import TrainConfig
from elastic_mnist.state import snapshots


def _run_dir(root, name: str, mb: int, age_s: float):
    if not (root / snapshots.ROOT_MARK).exists():
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        assert snapshots.claim_private(str(root)) is None
    path = root / snapshots.run_name(name) / "local0"
    os.close(snapshots.hold(str(path)))  # made and marked as a worker makes it; the lock goes with the fd
    (path / "ckpt-000000010.pt").write_bytes(b"\0" * (mb * 2**20))
    then = time.time() - age_s
    for p in (path / "ckpt-000000010.pt", path, path.parent, path / snapshots.LIVE_FILE,
              path.parent / snapshots.RUN_MARK):
        os.utime(p, (then, then))
    return path.parent


def test_sweep_removes_stale_runs_and_keeps_the_current_one(tmp_path):
    old = _run_dir(tmp_path, "old-job", 1, age_s=7 * 3600)
    recent = _run_dir(tmp_path, "recent-job", 1, age_s=60)
    mine = _run_dir(tmp_path, "my-job", 1, age_s=8 * 3600)
    removed = snapshots.sweep(str(tmp_path), keep_run=str(mine), max_age_s=6 * 3600)
    assert removed == [str(old)] and recent.exists() and mine.exists() and not old.exists()


def test_sweep_keeps_the_total_under_the_cap_oldest_first(tmp_path):
    runs = [_run_dir(tmp_path, f"job{i}", 2, age_s=600 - i * 100) for i in range(4)]  # job0 is the oldest
    mine = _run_dir(tmp_path, "mine", 2, age_s=0)
    removed = snapshots.sweep(str(tmp_path), keep_run=str(mine), max_age_s=3600, cap_bytes=6 * 2**20)
    assert removed == [str(runs[0]), str(runs[1])], "10 MiB held, cap 6: the two oldest go"
    assert all(r.exists() for r in runs[2:]) and mine.exists()


def test_a_directory_the_runtime_did_not_create_is_refused_unchanged_and_never_swept(tmp_path):
    """--snapshot-dir pointed at a user's project (or $HOME): not taken over, its mode and files untouched."""
    home = tmp_path / "home"
    old_project = home / "old-project"
    old_project.mkdir(parents=True)
    (old_project / "notes.txt").write_text("mine")
    os.chmod(home, 0o755)
    then = time.time() - 30 * 24 * 3600
    os.utime(old_project, (then, then))
    refused = snapshots.claim_private(str(home))
    assert refused and "did not write" in refused and "\n" not in refused
    assert (home.stat().st_mode & 0o777) == 0o755, "its mode is left as it was"
    assert snapshots.sweep(str(home), keep_run="", max_age_s=0, cap_bytes=1) == []
    assert (old_project / "notes.txt").read_text() == "mine" and sorted(os.listdir(home)) == ["old-project"]


def test_only_marked_run_dirs_of_the_right_form_are_swept(tmp_path):
    old = _run_dir(tmp_path, "old-job", 1, age_s=7 * 3600)
    lookalike = tmp_path / "job-0123456789ab"  # the form, but not made by the runtime (no mark, other content)
    (lookalike / "data").mkdir(parents=True)
    decoy = tmp_path / "something"  # no form at all
    decoy.mkdir()
    for p in (lookalike, decoy):
        os.utime(p, (0, 0))
    assert snapshots.sweep(str(tmp_path), keep_run="", max_age_s=3600) == [str(old)]
    assert lookalike.exists() and decoy.exists()


def test_an_empty_private_directory_is_adopted_and_a_readable_one_refused(tmp_path):
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    assert snapshots.claim_private(str(private)) is None and (private / snapshots.ROOT_MARK).is_file()
    refused = snapshots.claim_private(str(shared))
    assert refused and "readable by others" in refused and os.listdir(shared) == []
    assert (shared.stat().st_mode & 0o777) == 0o755


def test_a_root_holding_only_its_mark_is_removed_by_its_owner(tmp_path):
    root = tmp_path / "root"
    assert snapshots.claim_private(str(root)) is None
    assert snapshots.remove_root_if_unused(str(root)) and not root.exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    assert not snapshots.remove_root_if_unused(str(foreign)) and foreign.exists()


def test_flags_are_validated():
    with pytest.raises(Exception, match="snapshot-cap-mb"):
        TrainConfig(snapshot_cap_mb=-1).validate()


@pytest.mark.slow
def test_finished_jobs_leave_nothing_in_memory(tmp_path, small_mnist):
    """Three real torchrun jobs, one after another: each removes its own snapshots when it finishes,
    and a stale directory of a crashed run is swept by the next start."""
    shm = tmp_path / "shm"
    crashed = _run_dir(shm, "crashed-run", 1, age_s=2 * 3600)
    for i in range(3):
        args = [f"--data-dir={small_mnist}", f"--checkpoint-dir={tmp_path / f'ckpt{i}'}",
                f"--log-dir={tmp_path / f'runs{i}'}", "--max-steps=12", "--snapshot-every=5", f"--snapshot-dir={shm}",
                "--snapshot-max-age-h=1"]
        cmd = procs.torchrun_command(["--standalone", "--nproc-per-node=1", f"--rdzv-id=snap{i}"], args)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=procs.child_env(),
                                            cwd=REPO)
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads((tmp_path / f"runs{i}" / "summary.json").read_text())["snapshots_taken"] == 2
        assert ("[snapshots] removed 1" in done.stdout) == (i == 0), done.stdout[-2000:]
    assert not crashed.exists()
    assert os.listdir(shm) == [snapshots.ROOT_MARK], "finished jobs removed their own snapshots"
