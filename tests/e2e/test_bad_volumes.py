"""Bad volumes with real torchrun workers: a snapshot directory on a full tmpfs, a log and checkpoint volume
that is full when the job starts, and a checkpoint directory where the files named newest are unreadable or
refused by the loader."""

from __future__ import annotations

import os
import subprocess
import time

from conftest import REPO, run_torchrun, worker_env
from test_bad_volume import Planted
from volumes import fill, tiny_tmpfs

from e2e.test_chaos import assert_replays_plan, run_local
from elastic_mnist import procs
from elastic_mnist.runlog import events_dir, read_records
from elastic_mnist.state import format as checkpoint
from elastic_mnist.state import snapshots
from elastic_mnist.state.writer import CORRUPT_DIR


def _args(data: str, tmp, *extra: str) -> list[str]:
    return ["--data-dir", data, "--checkpoint-dir", str(tmp / "ckpt"), "--log-dir", str(tmp / "runs"),
            "--global-batch-size", "32", "--checkpoint-every", "50", "--keep-checkpoints", "3", *extra]


def test_refused_and_corrupt_files_named_newest_cost_nothing(small_mnist, tmp_path):
    """Five unreadable files and one the loader refuses, all named newer than the good checkpoints: both
    ranks resume from the newest good one at once (no agreement left waiting), and the run's own
    checkpoints are the ones kept."""
    first = run_torchrun(["--standalone", "--nproc-per-node=2"], _args(small_mnist, tmp_path, "--max-steps", "200"))
    assert first.returncode == 0, first.stderr[-3000:]
    for step in range(900, 905):
        (tmp_path / "ckpt" / f"ckpt-{step:09d}.pt").write_bytes(b"EMNISTCK" + os.urandom(4000))
    (tmp_path / "ckpt" / "ckpt-000000910.pt").write_bytes(checkpoint.encode({"step": 910, "p": Planted()}))
    t0 = time.monotonic()
    second = run_torchrun(["--standalone", "--nproc-per-node=2"], _args(small_mnist, tmp_path, "--max-steps", "400"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "[resume] step 200 " in second.stdout and "Traceback" not in second.stderr
    assert time.monotonic() - t0 < 60, "no rank waited out a collective timeout"
    kept = [s for s, _ in checkpoint.list_checkpoints(str(tmp_path / "ckpt"))]
    assert len(kept) == 3 and kept[0] == 400 and min(kept) > 200, f"the run's own newest three: {kept}"
    assert len(os.listdir(tmp_path / "ckpt" / CORRUPT_DIR)) == 6, "unusable files moved aside, kept"


def test_a_full_snapshot_tmpfs_costs_at_most_a_step(small_mnist, tmp_path):
    """Snapshots on a 3 MiB tmpfs (the MLP's state is ~4.9 MB): each worker turns them off with one line,
    the job trains through a kill on durable checkpoints, nothing is left in the tmpfs."""
    with tiny_tmpfs(tmp_path / "shm", 3 * 1024) as shm:
        report = run_local(small_mnist, tmp_path / "run", "kill:n1@step=40", "--snapshot-dir", str(shm),
                           "--snapshot-every", "5", steps=90)
        left = [f for _, _, files in os.walk(shm) for f in files
                if not f.startswith(".live") and f != snapshots.ROOT_MARK]  # the root stays the runtime's
    (event,) = report["events"]
    assert event["kind"] == "kill" and event["steps_redone"] <= 1
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "nodes").glob("*.log"))
    assert "Traceback" not in logs and "snapshots off on this worker" in logs
    assert left == [], f"temp or snapshot files left in the tmpfs: {left}"
    assert_replays_plan(tmp_path / "run", 90)


def test_a_snapshot_root_open_to_others_is_refused_with_one_line_and_training_goes_on(small_mnist, tmp_path):
    root = tmp_path / "shared-shm"
    root.mkdir()
    root.chmod(0o777)  # what a first user's `mkdir` with umask 0 leaves for everyone
    run = run_torchrun(["--standalone", "--nproc-per-node=2"],
                       _args(small_mnist, tmp_path, "--max-steps", "20", "--snapshot-dir", str(root),
                             "--snapshot-every", "5"))
    assert run.returncode == 0, run.stderr[-3000:]
    refusals = [line for line in run.stderr.splitlines() if "snapshots off on this worker" in line]
    assert len(refusals) == 2 and all("writable by others (mode 777)" in line for line in refusals), refusals
    assert os.listdir(root) == [], "nothing written into it"
    assert checkpoint.load_latest(str(tmp_path / "ckpt"))[0]["step"] == 20


def test_a_full_log_and_checkpoint_volume_warns_once_and_the_run_ends_with_everything_written(small_mnist, tmp_path):
    """--log-dir and --checkpoint-dir on one tmpfs that is full when the job starts: a rank warns once and
    trains on; the volume is given room at the first warning; writing resumes (one line per rank that
    warned), and the run ends at its last step with its final checkpoint, model.pt and a journal of whole
    lines."""
    with tiny_tmpfs(tmp_path / "vol", 64 * 1024) as vol:
        os.makedirs(vol / "ckpt")
        filler = fill(vol)
        args = [*_args(small_mnist, vol, "--max-steps", "300"), "--snapshot-dir", str(tmp_path / "shm")]
        job = subprocess.Popen(procs.torchrun_command(["--standalone", "--nproc-per-node=2"], args), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=worker_env(), cwd=REPO)
        first = []
        for line in job.stderr:  # until the first warning: then the operator frees the volume
            first.append(line)
            if "warning: cannot write" in line:
                os.unlink(filler)
                break
        out, rest = job.communicate(timeout=300)
        err = "".join(first) + rest
        assert job.returncode == 0, err[-3000:]
        journal = read_records(events_dir(str(vol / "runs")))  # every line whole, or this raises
        final = checkpoint.load_latest(str(vol / "ckpt"))[0]["step"]
        outputs = sorted(os.listdir(vol / "runs"))
    assert "No space left on device (ENOSPC)" in err and "Traceback" not in err
    for rank in (0, 1):
        warned = err.count(f"[rank {rank}] warning: cannot write")
        assert warned <= 1 and err.count(f"[rank {rank}] writing into the volume of") == warned, err[-3000:]
    assert final == 300 and "model.pt" in outputs and "summary.json" in outputs
    assert any(r["event"] == "done" for r in journal) and "[done] step 300" in out
