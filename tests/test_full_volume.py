"""A log or checkpoint volume that fills up or turns read-only while a job trains, on a real tmpfs: one
warning for the volume, training goes on to its last step, nothing is half-written, writing resumes (one
line) when room returns, and a final state the checkpoint volume cannot take stays in a snapshot."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_bad_volume import _config, _data
from trainers import in_process_trainer
from volumes import fill, remount, tiny_tmpfs

from elastic_mnist import volume
from elastic_mnist.contract import exit_codes
from elastic_mnist.distributed import DistEnv
from elastic_mnist.runlog import RunLog, events_dir, read_records
from elastic_mnist.state import format as checkpoint
from elastic_mnist.state.fence import FINISHED_FILE
from elastic_mnist.state.writer import CheckpointWriter
from elastic_mnist.worker.life import write_final

FULL = "warning: cannot write"
RESUMED = "resumed ("


def _lines(capsys, text: str) -> list[str]:
    """The printed lines holding text (a writer built without a Metrics warns on stdout)."""
    printed = capsys.readouterr()
    return [line for line in (printed.out + printed.err).splitlines() if text in line]


def test_a_full_journal_skips_whole_lines_warns_once_and_resumes(tmp_path, capsys):
    with tiny_tmpfs(tmp_path / "logs", 256) as mount:
        log = RunLog(str(mount / "runs"), "", rank=0, world_size=1, restart=0)
        filler = fill(mount, leave_pages=1)
        for i in range(5):  # the first line fits only in part: what went in is taken back out
            log.event("big", n=i, pad="x" * 6000)
        assert len(_lines(capsys, FULL)) == 1
        os.unlink(filler)
        log.event("after", n=5)
        err = capsys.readouterr().err
        log.close()
        records = read_records(events_dir(str(mount / "runs")))
        raw = open(os.path.join(events_dir(str(mount / "runs")), os.listdir(events_dir(str(mount / "runs")))[0])).read()
    assert err.count(RESUMED) == 1 and "5 write(s) skipped" in err, err
    assert [r["event"] for r in records] == ["after"] and raw.endswith("\n") and raw.count("\n") == 1


def test_a_read_only_log_volume_at_start_warns_once_and_resumes_when_writable(tmp_path, capsys):
    with tiny_tmpfs(tmp_path / "logs", 256) as mount:
        os.makedirs(mount / "runs" / "events")
        remount(mount, read_only=True)
        log = RunLog(str(mount / "runs"), "", rank=0, world_size=1, restart=0)  # opening does not raise
        log.event("lost")
        log.event("lost")
        warned = _lines(capsys, FULL)
        remount(mount, read_only=False)
        log.event("kept")
        log.close()
        records = read_records(events_dir(str(mount / "runs")))
    assert len(warned) == 1 and "(EROFS)" in warned[0]
    assert [r["event"] for r in records] == ["kept"] and RESUMED in capsys.readouterr().err


def test_other_write_errors_still_fail_the_save(tmp_path):
    writer = CheckpointWriter(str(tmp_path / "ckpt"), keep=2)
    (tmp_path / "ckpt").write_text("a file where the directory was\n")
    writer.save({"step": 1, "x": torch.zeros(4)}, 1)
    with pytest.raises(RuntimeError, match="checkpoint write to .* failed"):
        writer.wait()
    assert volume.room_error(FileExistsError(17, "exists")) is None


def _launched(tmp_path, mount, **kw):
    config = _config(tmp_path, checkpoint_dir=str(mount / "ckpt"), snapshot_dir=str(tmp_path / "shm"),
                     snapshot_every=5, **kw)
    return config, in_process_trainer(config, *_data(), env=DistEnv(launched=True, run_id="job"))


def test_checkpoints_skip_a_full_volume_and_resume_when_room_returns(tmp_path, capsys, monkeypatch):
    """The volume is full from the start; the operator frees it after the warning: the saves due meanwhile
    are skipped, the next one is written, and the run ends with its final checkpoint."""
    with tiny_tmpfs(tmp_path / "vol", 8 * 1024) as mount:
        os.makedirs(mount / "ckpt")
        filler = fill(mount)
        failed = volume.Volume.failed

        def warn_then_free(self, *args):
            failed(self, *args)
            if os.path.exists(filler):
                os.unlink(filler)
        monkeypatch.setattr(volume.Volume, "failed", warn_then_free)
        config, trainer = _launched(tmp_path, mount)
        code = write_final(config, trainer, trainer.train())
        steps = [s for s, _ in checkpoint.list_checkpoints(str(mount / "ckpt"))]
    err = capsys.readouterr().err
    assert code == exit_codes.OK and trainer.progress.step == 40
    assert err.count(FULL) == 1 and "No space left on device (ENOSPC)" in err and err.count(RESUMED) == 1, err
    assert steps[0] == 40, steps


def test_a_final_state_the_checkpoint_volume_cannot_take_stays_in_a_snapshot(tmp_path, capsys):
    with tiny_tmpfs(tmp_path / "vol", 8 * 1024) as mount:
        os.makedirs(mount / "ckpt")
        filler = fill(mount)
        config, trainer = _launched(tmp_path, mount, max_steps=20)
        code = write_final(config, trainer, trainer.train())
        err = capsys.readouterr().err
        assert code == exit_codes.SAVE_FAILED and trainer.progress.step == 20
        assert err.count(FULL) == 1 and "the final state (step 20) is not in" in err and "snapshot" in err, err
        assert checkpoint.list_checkpoints(str(mount / "ckpt")) == [] and not (mount / "ckpt" / FINISHED_FILE).exists()
        os.unlink(filler)  # room again: the restart under the same run id finishes from the snapshot
        config, again = _launched(tmp_path, mount, max_steps=20)
        assert again.progress.step == 20, "resumed from the snapshot of the final step"
        assert write_final(config, again, again.train()) == exit_codes.OK
        assert checkpoint.load_latest(str(mount / "ckpt"))[0]["step"] == 20
        assert json.loads((tmp_path / "runs" / "summary.json").read_text())["global_step"] == 20


def test_a_full_log_volume_at_the_end_loses_nothing(tmp_path, capsys):
    with tiny_tmpfs(tmp_path / "logs", 1024) as mount:
        config = _config(tmp_path, log_dir=str(mount / "runs"), max_steps=20)
        trainer = in_process_trainer(config, *_data())
        fill(mount)
        code = write_final(config, trainer, trainer.train())
        left = sorted(os.listdir(mount / "runs"))
    out = capsys.readouterr()
    assert code == exit_codes.OK and out.err.count(FULL) == 1, out.err
    assert "summary not written" in out.out and f"the trained state is in {tmp_path / 'ckpt'}" in out.out, out.out
    assert "model.pt" not in left and "summary.json" not in left
    assert checkpoint.load_latest(str(tmp_path / "ckpt"))[0]["step"] == 20, "the trained state is in the checkpoint"


def test_a_read_only_checkpoint_volume_skips_saves_and_resumes_when_writable(tmp_path, capsys):
    with tiny_tmpfs(tmp_path / "vol", 1024) as mount:
        writer = CheckpointWriter(str(mount / "ckpt"), keep=3)
        writer.save({"step": 1, "x": torch.zeros(4)}, 1, block=True)
        remount(mount, read_only=True)
        for step in (2, 3):
            writer.save({"step": step, "x": torch.zeros(4)}, step, block=True)
        warned = _lines(capsys, FULL)
        remount(mount, read_only=False)
        writer.save({"step": 4, "x": torch.zeros(4)}, 4, block=True)
        steps = [s for s, _ in checkpoint.list_checkpoints(str(mount / "ckpt"))]
    assert len(warned) == 1 and "Read-only file system (EROFS)" in warned[0]
    assert steps == [4, 1] and writer.held_step == 4 and len(_lines(capsys, RESUMED)) == 1


def test_a_failure_save_the_checkpoint_volume_cannot_take_goes_into_a_snapshot(tmp_path, capsys):
    with tiny_tmpfs(tmp_path / "vol", 8 * 1024) as mount:
        os.makedirs(mount / "ckpt")
        _, trainer = _launched(tmp_path, mount, max_steps=12)
        trainer.train()
        fill(mount)
        trainer.progress.step += 1  # a step past the last checkpoint, as when a peer dies mid-run
        where = trainer.checkpoints.save_on_failure()
    kept = checkpoint.load_latest(os.path.dirname(where.split(",")[0]))
    assert where.endswith("an in-memory snapshot: " + str(mount / "ckpt") + " cannot be written"), where
    assert kept[0]["step"] == 13 and capsys.readouterr().err.count(FULL) == 1
