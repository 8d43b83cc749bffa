"""Storage outside the happy path, with real files and real small trainers: a snapshot directory that is
full, foreign or open to others; checkpoint directories holding files that do not verify or that the
loader refuses; a keyed digest that refuses planted files."""

from __future__ import annotations

import hashlib
import hmac
import os

import pytest
import torch
from trainers import in_process_trainer
from volumes import tiny_tmpfs

from elastic_mnist import job_secret
from elastic_mnist.config import TrainConfig
from elastic_mnist.contract.env import SECRET_FILE_ENV
from elastic_mnist.contract.errors import UserError
from elastic_mnist.data.mnist import Split
from elastic_mnist.distributed import DistEnv
from elastic_mnist.metrics import Metrics
from elastic_mnist.state import format as checkpoint
from elastic_mnist.state import snapshots
from elastic_mnist.state.format import CheckpointError
from elastic_mnist.state.snapshotter import Snapshotter
from elastic_mnist.state.writer import CORRUPT_DIR, CheckpointWriter


class Planted:
    """A class outside torch's weights_only allow-list: what a task with an unusual state type writes."""


def _data(n: int = 640) -> tuple[Split, Split]:
    gen = torch.Generator().manual_seed(0)
    return (Split(torch.randn(n, 784, generator=gen), torch.randint(0, 10, (n,), generator=gen)),
            Split(torch.randn(64, 784, generator=gen), torch.randint(0, 10, (64,), generator=gen)))


def _config(tmp_path, **kw) -> TrainConfig:
    base = {"global_batch_size": 32, "max_steps": 40, "checkpoint_every": 10, "log_dir": str(tmp_path / "runs"),
            "checkpoint_dir": str(tmp_path / "ckpt"), "log_every": 1000, "keep_checkpoints": 3, "hidden": 64}
    return TrainConfig(**{**base, **kw})


def _steps(directory) -> list[int]:
    return [s for s, _ in checkpoint.list_checkpoints(str(directory))]


def test_corrupt_files_named_newer_never_displace_good_checkpoints(tmp_path):
    in_process_trainer(_config(tmp_path, max_steps=20), *_data()).train()
    for step in range(900, 905):  # a torn copy, a partial rsync
        (tmp_path / "ckpt" / f"ckpt-{step:09d}.pt").write_bytes(b"EMNISTCK" + os.urandom(100))
    resumed = in_process_trainer(_config(tmp_path, max_steps=60), *_data())
    assert resumed.progress.step == 20, "resumed from the newest good checkpoint, past five unreadable ones"
    resumed.train()
    assert _steps(tmp_path / "ckpt") == [60, 50, 40], "the run's own newest three, none displaced"
    assert sorted(os.listdir(tmp_path / "ckpt" / CORRUPT_DIR)) == [f"ckpt-{s:09d}.pt" for s in range(900, 905)]


def test_a_corrupt_file_under_the_name_of_a_save_does_not_block_it(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "ckpt-000000010.pt").write_bytes(b"EMNISTCK torn")  # one of ours, torn
    trainer = in_process_trainer(_config(tmp_path, max_steps=10), *_data())
    assert trainer.progress.step == 0
    trainer.train()
    state, path = checkpoint.load_latest(str(tmp_path / "ckpt"))
    assert state["step"] == 10 and path.endswith("ckpt-000000010.pt"), "the good save took its name"
    assert os.listdir(tmp_path / "ckpt" / CORRUPT_DIR) == ["ckpt-000000010.pt"]
    assert capsys.readouterr().err.count("moved aside") == 1, "reported once"


def test_another_programs_file_under_a_checkpoint_name_is_refused_at_start_and_never_moved(tmp_path):
    (tmp_path / "ckpt").mkdir()
    theirs = tmp_path / "ckpt" / "ckpt-000000010.pt"
    theirs.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="did not write .*move them away, or pass another --checkpoint-dir"):
        in_process_trainer(_config(tmp_path, max_steps=10), *_data())
    assert theirs.read_bytes() == b"not a checkpoint" and sorted(os.listdir(tmp_path / "ckpt")) == [theirs.name]


def test_a_file_the_loader_refuses_is_skipped_like_a_truncated_one(tmp_path):
    in_process_trainer(_config(tmp_path, max_steps=20), *_data()).train()
    planted = checkpoint.encode({"step": 900, "payload": Planted()})  # valid header and checksum
    (tmp_path / "ckpt" / "ckpt-000000900.pt").write_bytes(planted)
    with pytest.raises(CheckpointError, match=r"refused by torch.load\(weights_only=True\): UnpicklingError"):
        checkpoint.decode(planted)
    warnings: list[str] = []
    state, path = checkpoint.load_latest(str(tmp_path / "ckpt"), warn=warnings.append)
    assert state["step"] == 20 and len(warnings) == 1 and "ckpt-000000900.pt" in warnings[0]
    assert in_process_trainer(_config(tmp_path, max_steps=30), *_data()).progress.step == 20


def test_a_keyed_digest_refuses_planted_and_unkeyed_files_before_unpickling(tmp_path):
    key, other = checkpoint.checkpoint_key(b"s" * 32), checkpoint.checkpoint_key(b"t" * 32)
    blob = checkpoint.encode({"step": 1}, key)
    assert checkpoint.decode(blob, "k", key)["step"] == 1
    with pytest.raises(checkpoint.KeyMismatch, match="keyed with another job secret than this run's"):
        checkpoint.decode(blob, "k", other)
    with pytest.raises(checkpoint.KeyMismatch, match="keyed with a job secret, and this run has none"):
        checkpoint.decode(blob, "k")
    # Unkeyed, with a payload that is no pickle at all: refused by its header, the loader never runs.
    unkeyed = checkpoint.encode({"step": 1})[:44] + b"\x00garbage"
    with pytest.raises(checkpoint.KeyMismatch, match="written without a job secret, and this run has one"):
        checkpoint.decode(unkeyed, "k", key)
    # Our key's name copied into a file keyed otherwise (it is no secret): the HMAC refuses it, as damage.
    forged = bytearray(checkpoint.encode({"step": 1}, other))
    forged[12:20] = blob[12:20]
    with pytest.raises(CheckpointError, match="digest mismatch") as e:
        checkpoint.decode(bytes(forged), "k", key)
    assert not isinstance(e.value, checkpoint.KeyMismatch)


def _unnamed(state: dict, key: bytes) -> bytes:
    """A checkpoint in the keyed format before key names (version 2)."""
    payload = checkpoint.encode(state)[checkpoint._HEADER.size:]
    return checkpoint._HEADER.pack(checkpoint.MAGIC, checkpoint.KEYED_VERSION,
                                   hmac.new(key, payload, hashlib.sha256).digest()) + payload


def test_a_file_of_the_keyed_format_before_key_names_still_verifies(tmp_path):
    key, other = checkpoint.checkpoint_key(b"s" * 32), checkpoint.checkpoint_key(b"t" * 32)
    assert checkpoint.decode(_unnamed({"step": 3}, key), "k", key)["step"] == 3
    for step in (10, 20):
        checkpoint.write_durable(checkpoint.path_for(str(tmp_path), step), _unnamed({"step": step}, other))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(UserError, match="holds 2 checkpoint.* keyed with another job secret than this run's"):
        checkpoint.refuse_other_key(str(tmp_path), key)
    # One that verifies proves the key: the other is damage, skipped (and moved aside by a save) as before.
    checkpoint.write_durable(checkpoint.path_for(str(tmp_path), 5), _unnamed({"step": 5}, key))
    checkpoint.refuse_other_key(str(tmp_path), key)
    assert sorted(os.listdir(tmp_path)) == sorted([*before, "ckpt-000000005.pt"])


def test_a_file_of_another_key_is_never_moved_aside_by_a_save(tmp_path):
    key = checkpoint.checkpoint_key(b"s" * 32)
    for step in (10, 20):
        checkpoint.write_durable(checkpoint.path_for(str(tmp_path), step), checkpoint.encode({"step": step}))
    warnings: list[str] = []
    CheckpointWriter(str(tmp_path), keep=1, key=key, warn=warnings.append).save({"step": 30}, 30, block=True)
    assert _steps(tmp_path) == [30, 20, 10] and not (tmp_path / CORRUPT_DIR).exists()
    assert len(warnings) == 2 and all("left where it is" in w for w in warnings)


def test_snapshots_on_a_full_tmpfs_turn_off_with_one_line_and_leave_nothing(tmp_path, capsys):
    with tiny_tmpfs(tmp_path / "shm", 1024) as shm:
        place = snapshots.place(str(shm), "job", 0, str(tmp_path / "ckpt"), enabled=True)
        taker = Snapshotter(str(shm), place, None, Metrics(0, ""))
        big = {"step": 5, "x": torch.zeros(2**19)}  # 2 MiB, on a 1 MiB tmpfs
        taker.take(lambda: big, 5, estimate=lambda: 0)  # an estimate that lies: the write itself fails
        taker.writer.wait()
        taker.take(lambda: big, 10, estimate=lambda: 0)  # the failure is seen: off, nothing more written
        assert taker.writer is None
        taker.take(lambda: big, 15, estimate=lambda: 0)
        leftovers = [f for _, _, files in os.walk(shm) for f in files
                     if f not in (snapshots.LIVE_FILE, snapshots.ROOT_MARK, snapshots.RUN_MARK)]
        taker.close()
    err = capsys.readouterr().err
    assert err.count("snapshots off on this worker") == 1 and "No space left on device" in err
    assert leftovers == [], "no partial temp file stays"


def test_a_snapshot_that_would_not_fit_is_not_attempted(tmp_path, capsys):
    with tiny_tmpfs(tmp_path / "shm", 1024) as shm:
        place = snapshots.place(str(shm), "job", 0, str(tmp_path / "ckpt"), enabled=True)
        taker = Snapshotter(str(shm), place, None, Metrics(0, ""))
        taker.take(lambda: pytest.fail("no copy is made"), 5, estimate=lambda: 2**21)
        taker.close()
    assert "a snapshot needs about 3.2 MiB" in capsys.readouterr().err


@pytest.mark.parametrize("problem", ["world-writable", "foreign"])
def test_a_snapshot_root_open_to_others_is_refused_with_one_line(tmp_path, capsys, problem):
    root = tmp_path / "shm-root"
    root.mkdir()
    if problem == "world-writable":
        root.chmod(0o777)
    elif os.geteuid() == 0:
        os.chown(root, 12345, 12345)
    else:
        pytest.skip("giving a directory to another user needs root (CI runs as root)")
    config = _config(tmp_path, max_steps=10, snapshot_dir=str(root), snapshot_every=2)
    trainer = in_process_trainer(config, *_data(), env=DistEnv(launched=True, run_id="job"))
    summary = trainer.train()
    err = capsys.readouterr().err
    assert summary["global_step"] == 10 and summary["snapshots_taken"] == 0, "trained on, without snapshots"
    assert err.count("snapshots off on this worker") == 1
    assert ("writable by others" if problem == "world-writable" else "belongs to uid 12345") in err
    assert os.listdir(root) == [], "nothing written into it"


def test_run_names_cannot_escape_or_collide_and_the_default_root_is_private(tmp_path):
    names = {snapshots.run_name(r) for r in ("..", ".", "a/b", "a_b", "a b")}
    assert len(names) == 5 and all("/" not in n and not n.startswith(".") for n in names)
    root = tmp_path / "elastic-mnist-{uid}"
    assert snapshots.claim_private(snapshots.root_of(str(root))) is None
    made = tmp_path / f"elastic-mnist-{os.geteuid()}"
    assert made.is_dir() and (made.stat().st_mode & 0o777) == 0o700


def test_the_sweep_never_removes_a_live_runs_snapshots(tmp_path):
    assert snapshots.claim_private(str(tmp_path)) is None  # an empty private directory: adopted as a root
    live, dead = (snapshots.place(str(tmp_path), run, 0, "c", True) for run in ("live", "dead"))
    fd = snapshots.hold(live.directory)
    os.close(snapshots.hold(dead.directory))  # its worker is gone: the kernel dropped its lock
    for place in (live, dead):
        CheckpointWriter(place.directory, 2).save({"step": 1, "x": torch.zeros(1000)}, 1, block=True)
    try:
        removed = snapshots.sweep(str(tmp_path), keep_run="", max_age_s=1e9, cap_bytes=1)
    finally:
        os.close(fd)
    assert removed == [dead.run_root] and os.path.isdir(live.directory)


def test_with_a_job_secret_the_worker_keys_its_checkpoints_and_refuses_planted_ones(tmp_path, monkeypatch):
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(16).hex())
    secret.chmod(0o600)
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret))
    in_process_trainer(_config(tmp_path, max_steps=20), *_data()).train()
    state = checkpoint.load_latest(str(tmp_path / "ckpt"), key=_key(secret))[0] | {"step": 900}
    # Keyed with another secret under this job's key name (copied from a header): skipped as damage.
    forged = bytearray(checkpoint.encode(state, checkpoint.checkpoint_key(b"x" * 32)))
    forged[12:20] = (tmp_path / "ckpt" / "ckpt-000000020.pt").read_bytes()[12:20]
    (tmp_path / "ckpt" / "ckpt-000000900.pt").write_bytes(bytes(forged))
    assert in_process_trainer(_config(tmp_path, max_steps=30), *_data()).progress.step == 20
    # Unkeyed: another key than the run's, a configuration error naming it; nothing moved.
    (tmp_path / "ckpt" / "ckpt-000000900.pt").write_bytes(checkpoint.encode(state))
    with pytest.raises(UserError, match="written without a job secret, and this run has one"):
        in_process_trainer(_config(tmp_path, max_steps=40), *_data())
    assert 900 in _steps(tmp_path / "ckpt") and not (tmp_path / "ckpt" / CORRUPT_DIR).exists()
    with pytest.raises(checkpoint.KeyMismatch, match="keyed with a job secret"):
        checkpoint.decode((tmp_path / "ckpt" / "ckpt-000000020.pt").read_bytes())


def _key(secret_file) -> bytes:
    return checkpoint.checkpoint_key(job_secret.read(str(secret_file), "test"))
