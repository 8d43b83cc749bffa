"""The generation fence with node-local checkpoint dirs: every rank of a group writes rank 0's token into
its own dir, so whichever dir a newer group's rank shares, the older group finds it and leaves.

    python -m pytest -q tests/test_fence.py

Two real processes in a real gloo group (tests/gloo_group.py), each with its own --checkpoint-dir.
"""

import json
import os

import pytest
import torch
from gloo_group import run_group
from trainers import in_process_trainer

from elastic_mnist.config import TrainConfig
from elastic_mnist.data.mnist import Split
from elastic_mnist.distributed import DistEnv
from elastic_mnist.state import fence
from elastic_mnist.state import format as checkpoint


def _token(directory: str) -> str:
    with open(os.path.join(directory, fence.GENERATION_FILE)) as f:
        return json.load(f)["token"]


def _split(n: int) -> Split:
    gen = torch.Generator().manual_seed(0)
    return Split(torch.randn(n, 784, generator=gen), torch.randint(0, 10, (n,), generator=gen))


def _worker(rank: int, world: int, work: str) -> None:
    own = os.path.join(work, f"node{rank}")
    config = TrainConfig(global_batch_size=32, max_steps=40, checkpoint_every=5, log_every=1000,
                         log_dir=os.path.join(work, f"runs{rank}"),
                         checkpoint_dir=own, checkpoint_storage="local", keep_checkpoints=10)
    trainer = in_process_trainer(config, _split(640), _split(64), DistEnv(rank=rank, world_size=world))
    original = trainer.forward_backward

    def forward_backward(step):
        if step == 7 and rank == 1:  # a newer group's rank claims node 1's dir (not rank 0's)
            assert _token(own) == _token(os.path.join(work, "node0")), "one token for the whole group"
            fence.claim_generation(own, 1)
        return original(step)

    trainer.forward_backward = forward_backward
    trainer.train()
    with open(os.path.join(work, f"result{rank}.json"), "w") as f:
        json.dump({"superseded": trainer.superseded, "step": trainer.progress.step,
                   "saved": sorted(s for s, _ in checkpoint.list_checkpoints(own))}, f)


@pytest.mark.slow
def test_a_newer_group_in_any_local_dir_stops_the_whole_older_group(tmp_path):
    run_group(_worker, 2, str(tmp_path))
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2)]
    assert all(r["superseded"] for r in results), results
    assert [r["step"] for r in results] == [11, 11], "both stop one step after the save point that found it"
    assert results[1]["saved"] == [5], "the rank whose dir was claimed writes nothing after the claim"
    assert results[0]["saved"] == [5, 10], "rank 0's own dir was not claimed: its save at 10 was not fenced"
