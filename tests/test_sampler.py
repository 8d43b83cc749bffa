"""ElasticDistributedSampler and the DataLoader path give exactly the in-memory path's batches.

    python -m pytest -q tests/test_sampler.py

The contract: at every world size, each step's DataLoader batch holds the indices
`BatchPlan.rank_indices(step, world, rank)` names, and the very tensors `data.load_split` holds for
them; a resize mid-epoch continues with the next unseen samples.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from elastic_mnist.contract.errors import UserError
from elastic_mnist.data.loader import build_loader, mnist_dataset, mnist_datasets
from elastic_mnist.data.mnist import BatchPlan, load_split
from elastic_mnist.data.sampler import ElasticDistributedSampler

GLOBAL_BATCH, SEED = 100, 7  # 2,000 samples: 20 steps an epoch; 100 = 34 + 33 + 33 at world size 3


class WithIndex(Dataset):
    """The data set, each item tagged with the index it was loaded for (in whichever worker)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        x, y = self.dataset[i]
        return x, y, i


@pytest.fixture(scope="module")
def train(small_mnist: str) -> WithIndex:
    return WithIndex(mnist_dataset(small_mnist, train=True))


@pytest.fixture(scope="module")
def memory(small_mnist: str):
    return load_split(small_mnist, True)


def loader_for(dataset: Dataset, world: int, rank: int, workers: int):
    sampler = ElasticDistributedSampler(dataset, num_replicas=world, rank=rank, seed=SEED,
                                        global_batch_size=GLOBAL_BATCH)
    return sampler, build_loader(dataset, sampler, num_workers=workers)


def steps(loader, memory) -> list[list[int]]:
    """Each batch's indices, in order; checks its tensors against the in-memory path on the way."""
    seen = []
    for x, y, idx in loader:
        assert torch.equal(x.reshape(len(idx), -1), memory.images[idx]), "same normalized pixels"
        assert torch.equal(y, memory.labels[idx])
        seen.append(idx.tolist())
    return seen


@pytest.mark.vision
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_dataloader_yields_the_plans_indices_and_tensors(train, memory, world: int, workers: int) -> None:
    plan = BatchPlan(len(train), GLOBAL_BATCH, SEED)
    for rank in range(world):
        sampler, loader = loader_for(train, world, rank, workers)
        assert isinstance(sampler, DistributedSampler) and len(sampler) == len(loader) == 20
        expected = [plan.rank_indices(s, world, rank).tolist() for s in range(20)]
        assert steps(loader, memory) == expected
        sampler.set_step(20 + 15)  # resume late in epoch 1 on the same (persistent-worker) loader
        assert len(loader) == 5
        assert steps(loader, memory) == [plan.rank_indices(s, world, rank).tolist() for s in range(35, 40)]


@pytest.mark.vision
@pytest.mark.parametrize("workers", [0, 2])
def test_resize_mid_epoch_continues_with_the_next_unseen_samples(train, memory, workers: int) -> None:
    plan, k = BatchPlan(len(train), GLOBAL_BATCH, SEED), 7
    per_step: dict[int, list[int]] = {}
    for rank in range(2):  # steps 0..k-1 at world size 2, then the job stops
        _, loader = loader_for(train, 2, rank, workers)
        for step, idx in enumerate(steps(loader, memory)[:k]):
            per_step.setdefault(step, []).extend(idx)
    for rank in range(3):  # every node rebuilds its sampler for world size 3 and resumes at step k
        sampler, loader = loader_for(train, 3, rank, workers)
        sampler.set_step(k)
        assert len(sampler) == 20 - k
        got = steps(loader, memory)
        assert got == [plan.rank_indices(s, 3, rank).tolist() for s in range(k, 20)]
        for step, idx in enumerate(got, start=k):
            per_step.setdefault(step, []).extend(idx)
    assert [sorted(per_step[s]) for s in range(20)] == [sorted(plan.global_indices(s).tolist()) for s in range(20)]
    epoch = [i for s in range(20) for i in per_step[s]]
    assert len(epoch) == len(set(epoch)) == 20 * GLOBAL_BATCH, "no sample twice, none skipped"


def test_set_epoch_and_set_step() -> None:
    sampler = ElasticDistributedSampler(range(1000), num_replicas=2, rank=1, global_batch_size=100)
    plan = BatchPlan(1000, 100, 0)
    sampler.set_step(23)  # epoch 2, step 3
    sampler.set_epoch(2)  # the usual per-epoch call keeps the resume point inside that epoch
    assert (sampler.epoch, len(sampler)) == (2, 7)
    assert next(iter(sampler)) == plan.rank_indices(23, 2, 1).tolist()
    sampler.set_epoch(3)
    assert len(sampler) == 10 and next(iter(sampler)) == plan.rank_indices(30, 2, 1).tolist()
    assert list(iter(sampler)) == list(iter(sampler)), "iterating again repeats the epoch, as torch's does"


def test_uneven_shares_cover_the_global_batch_exactly_once() -> None:
    shares = [list(ElasticDistributedSampler(range(50), num_replicas=3, rank=r, global_batch_size=10))
              for r in range(3)]
    assert [len(s[0]) for s in shares] == [4, 3, 3]
    plan = BatchPlan(50, 10, 0)
    for step in range(5):
        assert [i for r in range(3) for i in shares[r][step]] == plan.global_indices(step).tolist()


def test_without_shuffle_the_epoch_walks_the_data_set_in_order() -> None:
    shares = [list(ElasticDistributedSampler(range(25), num_replicas=2, rank=r, shuffle=False,
                                             global_batch_size=5)) for r in range(2)]
    assert shares[0][:2] == [[0, 1, 2], [5, 6, 7]] and shares[1][:2] == [[3, 4], [8, 9]]


@pytest.mark.parametrize("kwargs, message", [
    ({"drop_last": False}, "drop_last=True"),
    ({"global_batch_size": 2}, "global_batch_size=2 must be between num_replicas=3"),
    ({"global_batch_size": 101}, "the data set's 100 samples"),
    ({"rank": 3}, "Invalid rank"),
])
def test_bad_arguments_are_refused_naming_the_fix(kwargs: dict, message: str) -> None:
    args = {"num_replicas": 3, "rank": 0, "global_batch_size": 10, **kwargs}
    with pytest.raises(ValueError, match=message):
        ElasticDistributedSampler(range(100), **args)


def test_a_negative_step_or_worker_count_is_refused() -> None:
    with pytest.raises(ValueError, match="global_step must be >= 0"):
        ElasticDistributedSampler(range(100), 3, 0, global_batch_size=10).set_step(-1)
    with pytest.raises(ValueError, match="num_workers"):
        build_loader(range(100), ElasticDistributedSampler(range(100), 3, 0, global_batch_size=10), -1)


@pytest.mark.vision
def test_missing_mnist_is_one_error_naming_the_fix(tmp_path) -> None:
    with pytest.raises(UserError, match=r"MNIST not found under .*MNIST/raw.*--data-dir"):
        mnist_datasets(str(tmp_path))
    assert list(tmp_path.iterdir()) == [], "nothing created where the data set was looked for"


def test_the_dataloader_path_without_torchvision_is_one_error_naming_the_fix(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # what a torch-only install sees: ImportError
    with pytest.raises(UserError, match=r"^--input dataloader needs torchvision.*elastic-mnist\[vision\]"):
        mnist_datasets(str(tmp_path))
