"""Where each step's batch comes from: this rank's share of the global batch the plan names.

    python -m elastic_mnist.train --data-dir ../shared/data --input dataloader --num-workers 2

Two sources, one contract (the same indices per step as `BatchPlan.rank_indices`, at any world size):
- MemoryInputs: tensors decoded once (`data.Split`), indexed on the device; the fast default.
- LoaderInputs: any map-style data set through a DataLoader driven by ElasticDistributedSampler, for
  data that does not fit in memory or needs per-sample transforms; rebuilt from the step on every start.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from elastic_mnist.data.mnist import BatchPlan, Split, shard_bounds

EVAL_BATCH = 1024


class MemoryInputs:
    def __init__(self, train: Split, test: Split, plan: BatchPlan, world_size: int, rank: int):
        self.train, self.test, self.plan = train, test, plan
        self.world_size, self.rank = world_size, rank

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, targets, dataset indices) of this rank's share of global step `step`."""
        idx = self.plan.rank_indices(step, self.world_size, self.rank)
        dev_idx = idx.to(self.train.images.device, non_blocking=True)
        return self.train.images[dev_idx], self.train.labels[dev_idx], idx

    def test_shard(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's contiguous share of the test set (scores are summed over ranks)."""
        start, end = shard_bounds(len(self.test), self.world_size, self.rank)
        yield self.test.images[start:end], self.test.labels[start:end]


class LoaderInputs:
    """A DataLoader over `train` whose batch sampler yields this rank's share of each global step."""

    def __init__(self, train, test, plan: BatchPlan, world_size: int, rank: int, device: torch.device,
                 num_workers: int = 0):
        from elastic_mnist.data.loader import build_loader
        from elastic_mnist.data.sampler import ElasticDistributedSampler

        self.test, self.plan, self.world_size, self.rank, self.device = test, plan, world_size, rank, device
        self.sampler = ElasticDistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True,
                                                 seed=plan.seed, drop_last=True,
                                                 global_batch_size=plan.global_batch_size)
        self.pin = device.type == "cuda"
        self.loader = build_loader(train, self.sampler, num_workers, self.pin)
        self._it, self._next = None, -1

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._it is None or step != self._next or self.plan.position(step)[1] == 0:
            self.sampler.set_step(step)  # a (re)start or a new epoch: the sampler resumes at this step
            self._it = iter(self.loader)
        x, y = next(self._it)
        self._next = step + 1
        idx = self.plan.rank_indices(step, self.world_size, self.rank)
        return x.to(self.device, non_blocking=self.pin), y.to(self.device, non_blocking=self.pin), idx

    def test_shard(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, end = shard_bounds(len(self.test), self.world_size, self.rank)
        shard = torch.utils.data.Subset(self.test, range(start, end))
        for x, y in torch.utils.data.DataLoader(shard, batch_size=EVAL_BATCH, pin_memory=self.pin):
            yield x.to(self.device, non_blocking=self.pin), y.to(self.device, non_blocking=self.pin)


def build_inputs(train, test, plan: BatchPlan, world_size: int, rank: int, device: torch.device,
                 num_workers: int = 0):
    """Tensor splits take the fast path; any other data set goes through a DataLoader."""
    if isinstance(train, Split) and isinstance(test, Split):
        return MemoryInputs(train.to(device), test.to(device), plan, world_size, rank)
    return LoaderInputs(train, test, plan, world_size, rank, device, num_workers)
