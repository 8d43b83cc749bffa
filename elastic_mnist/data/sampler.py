"""A DistributedSampler whose order is the same global batches at every world size (docs/sampler.md).

    python -c "from elastic_mnist.data.sampler import ElasticDistributedSampler as S; \
               print(list(S(range(10), num_replicas=3, rank=1, global_batch_size=4)))"

ElasticDistributedSampler is torch's DistributedSampler (same constructor) driven by `data.BatchPlan`:
epoch e is one permutation seeded by (seed, e), global step s of it is positions [s*B, (s+1)*B), and the
world size only decides how that global batch is split (contiguous shares, uneven when B does not divide
by the world size). Used as a DataLoader `batch_sampler`, it yields this rank's share of each global step,
so a job that resizes mid-epoch goes on with exactly the next unseen samples: rebuild it for the new
world size on every (re)start and call `set_step(global_step)`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data.distributed import DistributedSampler

from elastic_mnist.data.mnist import BatchPlan


class InOrderPlan(BatchPlan):
    """The plan without shuffling (shuffle=False): every epoch walks the data set in order."""

    def permutation(self, epoch: int) -> torch.Tensor:
        return torch.arange(self.num_samples)


class ElasticDistributedSampler(DistributedSampler):
    """Batch sampler: iterating yields, for each remaining global step of the current epoch, the list
    of dataset indices that make up this rank's share; `len()` is the number of those steps."""

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True, *,
                 global_batch_size: int) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)  # resolves and checks rank
        if not drop_last:
            raise ValueError("ElasticDistributedSampler needs drop_last=True: every epoch drops its last "
                             "partial global batch, so that each world size trains the same steps")
        n = len(dataset)
        if not self.num_replicas <= global_batch_size <= n:
            raise ValueError(f"global_batch_size={global_batch_size} must be between num_replicas="
                             f"{self.num_replicas} (every rank needs a sample per step) and the data set's "
                             f"{n} samples")
        self.global_batch_size = global_batch_size
        self.plan = (BatchPlan if shuffle else InOrderPlan)(n, global_batch_size, seed)
        self.start_step = 0  # within self.epoch: where the next iteration begins

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the first step of `epoch`; a resume point that set_step placed
        inside this same epoch is kept, so `set_step(s)` then the usual `set_epoch(e)` resumes mid-epoch."""
        if epoch != self.epoch:
            self.start_step = 0
        super().set_epoch(epoch)

    def set_step(self, global_step: int) -> None:
        """Resume at `global_step` (counted from the start of training, over all epochs)."""
        if global_step < 0:
            raise ValueError(f"global_step must be >= 0, not {global_step}")
        self.epoch, self.start_step = self.plan.position(global_step)

    def global_step(self, step_in_epoch: int) -> int:
        return self.epoch * self.steps_per_epoch + step_in_epoch

    def rank_indices(self, global_step: int) -> list[int]:
        """This rank's share of one global step: exactly `BatchPlan.rank_indices` at this world size."""
        return self.plan.rank_indices(global_step, self.num_replicas, self.rank).tolist()

    def __iter__(self) -> Iterator[list[int]]:  # type: ignore[override]
        for step in range(self.start_step, self.steps_per_epoch):
            yield self.rank_indices(self.global_step(step))

    def __len__(self) -> int:
        return self.steps_per_epoch - self.start_step

