"""The Trainer in one process with real small objects: stop requests, superseded groups, checkpoints."""

import signal

import torch

from elastic_mnist.config import TrainConfig
from elastic_mnist.data.mnist import Split
from elastic_mnist.state import format as checkpoint
from elastic_mnist.worker.control import StopRequest
from elastic_mnist.worker.trainer import Trainer, in_process_trainer


def _trainer(tmp_path, stop: StopRequest | None = None) -> Trainer:
    gen = torch.Generator().manual_seed(0)
    train = Split(torch.randn(640, 784, generator=gen), torch.randint(0, 10, (640,), generator=gen))
    test = Split(torch.randn(64, 784, generator=gen), torch.randint(0, 10, (64,), generator=gen))
    config = TrainConfig(global_batch_size=32, max_steps=40, checkpoint_every=5, log_dir=str(tmp_path / "runs"),
                         checkpoint_dir=str(tmp_path / "ckpt"), log_every=1000, keep_checkpoints=10)
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
            checkpoint.claim_generation(str(tmp_path / "ckpt"), 1)
        return original(step)

    trainer.forward_backward = forward_backward
    trainer.train()
    assert trainer.superseded and trainer.stopped_early
    assert trainer.progress.step == 11, "stops one step after the save point that found the newer group"
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path / "ckpt"))] == [5]


def test_generation_claims(tmp_path):
    first = checkpoint.claim_generation(str(tmp_path), 2)
    assert checkpoint.generation_is(str(tmp_path), first)
    second = checkpoint.claim_generation(str(tmp_path), 1)
    assert not checkpoint.generation_is(str(tmp_path), first) and checkpoint.generation_is(str(tmp_path), second)


def test_periodic_saves_and_epoch_end(tmp_path):
    trainer = _trainer(tmp_path)
    summary = trainer.train()
    steps = [s for s, _ in checkpoint.list_checkpoints(str(tmp_path / "ckpt"))]
    assert steps == [40, 35, 30, 25, 20, 15, 10, 5]  # every 5 steps; 20 and 40 are also epoch ends
    assert summary["epochs_completed"] == 2 and summary["test_accuracy"] is not None
    assert summary["checkpoint_block_ms_p95"] >= summary["checkpoint_block_ms_p50"] > 0
