"""Checkpoints: round trip, verified fallback, config refusal, keep-last-k, atomic writes."""

import os

import pytest
import torch

from elastic_mnist.contract.errors import UserError
from elastic_mnist.state import format as checkpoint
from elastic_mnist.state.format import CheckpointError
from elastic_mnist.state.writer import CheckpointWriter


def _state(step: int) -> dict:
    return {"step": step, "epoch": 0, "world_size": 2, "saved_at": 1.0, "weights": torch.full((4,), float(step)),
            "fingerprint": {"global_batch_size": 128, "hidden": 512}}


def test_round_trip(tmp_path):
    writer = CheckpointWriter(str(tmp_path), keep=3)
    writer.save(_state(10), 10, block=True)
    state, path = checkpoint.load_latest(str(tmp_path))
    assert path.endswith("ckpt-000000010.pt") and state["step"] == 10
    assert torch.equal(state["weights"], torch.full((4,), 10.0))


def test_truncated_latest_falls_back_to_previous_with_a_warning(tmp_path):
    writer = CheckpointWriter(str(tmp_path), keep=3)
    for step in (10, 20):
        writer.save(_state(step), step, block=True)
    newest = checkpoint.path_for(str(tmp_path), 20)
    blob = open(newest, "rb").read()
    with open(newest, "wb") as f:
        f.write(blob[: len(blob) // 2])
    warnings = []
    state, path = checkpoint.load_latest(str(tmp_path), warn=warnings.append)
    assert state["step"] == 10
    assert len(warnings) == 1 and "ckpt-000000020.pt" in warnings[0] and "truncated or corrupt" in warnings[0]
    assert os.path.exists(newest), "a damaged checkpoint is skipped, not deleted"


def test_flipped_byte_is_detected():
    blob = bytearray(checkpoint.encode(_state(5)))
    blob[-10] ^= 0xFF
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoint.decode(bytes(blob))


def test_incompatible_config_is_refused_by_name():
    state = _state(10)
    with pytest.raises(UserError, match=r"global_batch_size 128 \(checkpoint\) vs 64 \(now\)"):
        checkpoint.check_compatible(state, {"global_batch_size": 64, "hidden": 512}, "x.pt")
    checkpoint.check_compatible(state, {"global_batch_size": 128, "hidden": 512}, "x.pt")


def test_a_checkpoint_from_before_hidden_layers_counts_as_one_hidden_layer():
    state = _state(10)  # its fingerprint has no hidden_layers: it was written before the flag existed
    checkpoint.check_compatible(state, {"global_batch_size": 128, "hidden": 512, "hidden_layers": 1}, "x.pt")
    with pytest.raises(UserError, match=r"hidden_layers 1 \(checkpoint\) vs 3 \(now\)"):
        checkpoint.check_compatible(state, {"global_batch_size": 128, "hidden": 512, "hidden_layers": 3}, "x.pt")


def test_keep_last_k(tmp_path):
    writer = CheckpointWriter(str(tmp_path), keep=2)
    for step in (10, 20, 30, 40):
        writer.save(_state(step), step)
    writer.wait()
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path))] == [40, 30]
    assert writer.saved == 4


def test_interrupted_write_never_becomes_latest(tmp_path):
    """A writer killed mid-write leaves only a hidden temp file, which discovery never lists."""
    CheckpointWriter(str(tmp_path), keep=3).save(_state(10), 10, block=True)
    (tmp_path / ".ckpt-000000020.pt.tmp-999-1").write_bytes(checkpoint.encode(_state(20))[:100])
    state, _ = checkpoint.load_latest(str(tmp_path))
    assert state["step"] == 10


def test_a_late_writer_never_replaces_a_completed_checkpoint(tmp_path):
    path = checkpoint.path_for(str(tmp_path), 10)
    assert checkpoint.write_durable(path, checkpoint.encode(_state(10)))
    stale = _state(10)
    stale["weights"] = torch.zeros(4)
    assert not checkpoint.write_durable(path, checkpoint.encode(stale))
    assert torch.equal(checkpoint.load_latest(str(tmp_path))[0]["weights"], torch.full((4,), 10.0))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000000010.pt"], "no temp file left behind"


def test_unwritable_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="not writable"):
        checkpoint.ensure_writable(str(blocker / "ckpts"))


def test_weights_only_load_refuses_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    import hashlib
    import io
    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    payload = buf.getvalue()
    blob = checkpoint._HEADER.pack(checkpoint.MAGIC, checkpoint.FORMAT_VERSION, hashlib.sha256(payload).digest())
    with pytest.raises(Exception, match="Weights only load failed|Unsupported"):
        checkpoint.decode(blob + payload)


def test_a_closed_writer_ends_its_thread_and_a_later_save_still_writes(tmp_path):
    # A process kept across rounds makes a writer every round: a closed one must not leave its thread (or
    # the last state it wrote) behind, and the node's final save may still come through it.
    writer = CheckpointWriter(str(tmp_path), keep=3)
    writer.save(_state(1), 1, block=True)
    thread = writer._thread
    writer.close()
    writer.close()
    assert not thread.is_alive()
    writer.save(_state(2), 2, block=True)
    writer.close()
    state, path = checkpoint.load_latest(str(tmp_path))
    assert path.endswith("ckpt-000000002.pt") and state["step"] == 2


def test_a_checkpoint_removed_while_the_directory_is_checked_is_not_foreign(tmp_path, monkeypatch):
    """Another writer's keep-k may remove a checkpoint of ours between the listing and the read of its header
    (a joining node checks the directory while the job trains): what is gone is nobody's, what is planted stays
    foreign. The listing is pinned here, since real processes cannot hit that window at will."""
    planted = tmp_path / "ckpt-000000010.pt"
    planted.write_bytes(b"not ours")
    listed = checkpoint.list_checkpoints(str(tmp_path))
    gone = str(tmp_path / "ckpt-000000370.pt")  # listed, then removed before its header was read
    monkeypatch.setattr(checkpoint, "list_checkpoints", lambda directory: [(370, gone), *listed])
    assert checkpoint.foreign_files(str(tmp_path)) == [str(planted)]
