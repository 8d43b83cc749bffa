"""The Trainer in one process with real small objects: stop requests, superseded groups, checkpoints."""

import signal

import pytest
import torch
from trainers import in_process_trainer

from elastic_mnist.config import TrainConfig
from elastic_mnist.data.mnist import Split
from elastic_mnist.runlog import read_records
from elastic_mnist.state import fence
from elastic_mnist.state import format as checkpoint
from elastic_mnist.worker.control import StopRequest
from elastic_mnist.worker.trainer import Trainer


def _trainer(tmp_path, stop: StopRequest | None = None, log_every: int = 1000) -> Trainer:
    gen = torch.Generator().manual_seed(0)
    train = Split(torch.randn(640, 784, generator=gen), torch.randint(0, 10, (640,), generator=gen))
    test = Split(torch.randn(64, 784, generator=gen), torch.randint(0, 10, (64,), generator=gen))
    config = TrainConfig(global_batch_size=32, max_steps=40, checkpoint_every=5, log_dir=str(tmp_path / "runs"),
                         checkpoint_dir=str(tmp_path / "ckpt"), log_every=log_every, keep_checkpoints=10)
    return in_process_trainer(config, train, test, stop=stop)


def test_stop_request_checkpoints_at_the_next_step_boundary(tmp_path):
    stop = StopRequest()
    trainer = _trainer(tmp_path, stop=stop)
    original = trainer.forward_backward

    def forward_backward(step):
        if step == 7:
            stop._handle(signal.SIGTERM, None)  # what the signal handler does mid-step
        return original(step)

    trainer.forward_backward = forward_backward
    summary = trainer.train()
    assert trainer.stopped_early and summary["global_step"] == 8
    assert checkpoint.load_latest(str(tmp_path / "ckpt"))[0]["step"] == 8, "the stop step is saved, nothing lost"


def test_a_superseded_group_stops_without_writing(tmp_path):
    trainer = _trainer(tmp_path)
    original = trainer.forward_backward

    def forward_backward(step):
        if step == 7:  # a newer group claims the dir between the first and the second save
            fence.claim_generation(str(tmp_path / "ckpt"), 1)
        return original(step)

    trainer.forward_backward = forward_backward
    trainer.train()
    assert trainer.superseded and trainer.stopped_early
    assert trainer.progress.step == 11, "stops one step after the save point that found the newer group"
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path / "ckpt"))] == [5]


def test_progress_says_warming_up_until_a_rate_is_measured_and_never_reports_zero(tmp_path, capsys):
    _trainer(tmp_path, log_every=2).train()
    rates = [e["samples_per_s"] for e in read_records(str(tmp_path / "runs" / "events")) if e["event"] == "progress"]
    assert rates[:2] == [None, None] and all(r > 0 for r in rates[2:]) and len(rates) == 20
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[train]")]
    assert lines[0].endswith("samples/s (warming up)") and not lines[-1].endswith("samples/s 0")


def test_generation_claims(tmp_path):
    first = fence.claim_generation(str(tmp_path), 2)
    assert fence.generation_is(str(tmp_path), first)
    second = fence.claim_generation(str(tmp_path), 1)
    assert not fence.generation_is(str(tmp_path), first) and fence.generation_is(str(tmp_path), second)


def test_periodic_saves_and_epoch_end(tmp_path):
    trainer = _trainer(tmp_path)
    summary = trainer.train()
    steps = [s for s, _ in checkpoint.list_checkpoints(str(tmp_path / "ckpt"))]
    assert steps == [40, 35, 30, 25, 20, 15, 10, 5]  # every 5 steps; 20 and 40 are also epoch ends
    assert summary["epochs_completed"] == 2 and summary["test_accuracy"] is not None
    assert summary["checkpoint_block_ms_p95"] >= summary["checkpoint_block_ms_p50"] > 0


def test_a_resume_loads_one_progress_in_place_from_one_decode(tmp_path, monkeypatch):
    """The Progress the trainer counts with is the one the manager loaded (no second copy to fall out of
    step), and the newest checkpoint is decoded once on the way (when it was verified)."""
    _trainer(tmp_path).train()
    decodes = []
    original = checkpoint.decode
    monkeypatch.setattr(checkpoint, "decode",
                        lambda blob, name="", key=None: decodes.append(name) or original(blob, name, key))
    resumed = _trainer(tmp_path)
    assert resumed.progress is resumed.checkpoints.progress and resumed.progress.step == 40
    assert resumed.progress.resumes == 1 and resumed.progress.last_eval["step"] == 40
    assert decodes == [str(tmp_path / "ckpt" / "ckpt-000000040.pt")]


def test_a_checkpoint_of_another_set_of_objects_is_refused_before_anything_loads():
    from elastic_mnist.contract.errors import UserError
    from elastic_mnist.state.registry import Progress, load_into

    progress = Progress(step=3)
    with pytest.raises(UserError, match="holds no state for scheduler .*another task"):
        load_into({"progress": progress, "scheduler": Progress()}, {"progress": {"resumes": 9}}, "ckpt-1.pt")
    assert progress.resumes == 0, "nothing was loaded"
