"""The DataLoader input path: torchvision's MNIST with the seed's transforms, driven by the elastic sampler.

    python -m elastic_mnist.train --data-dir ../shared/data --input dataloader --num-workers 2

    train, test = mnist_datasets(root)
    sampler = ElasticDistributedSampler(train, world_size, rank, seed=0, global_batch_size=128)
    sampler.set_step(global_step)                      # where this (re)start resumes
    for x, y in build_loader(train, sampler, num_workers=2, pin_memory=True): ...

Items are what the seed's transforms make: x [1, 28, 28] float32 (ToTensor, then Normalize with MNIST's
mean and std), y an int; a batch is this rank's share of one global step. The in-memory path
(`data.load_split`) computes the same values, flattened to [784].
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import DataLoader, Dataset

from elastic_mnist.contract.errors import UserError
from elastic_mnist.data.mnist import MNIST_MEAN, MNIST_STD, raw_paths, read_split, torchvision
from elastic_mnist.data.sampler import ElasticDistributedSampler


def mnist_dataset(root: str, train: bool, download: bool = False) -> Dataset:
    """torchvision's MNIST over root/MNIST/raw/*-ubyte (the layout `data.load_split` reads)."""
    vision = torchvision("--input dataloader")  # imported here: ~1 s, paid only by the DataLoader path
    _, paths = raw_paths(root, train)
    if all(p.exists() for p in paths):
        read_split(paths)  # a bad file is one line naming it, as on the default path, not torchvision's traceback
    transforms = vision.transforms
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    try:
        return vision.datasets.MNIST(root=root, train=train, download=download, transform=transform)
    except RuntimeError as e:
        raise UserError(f"MNIST not found under {Path(root) / 'MNIST' / 'raw'} ({e}). Point --data-dir (or "
                        "$ELASTIC_MNIST_DATA_DIR) at a directory holding MNIST/raw/*-ubyte, or add --download"
                        ) from None


def mnist_datasets(root: str, download: bool = False) -> tuple[Dataset, Dataset]:
    """(train, test) for the DataLoader path; with download, the first call fetches the whole data set."""
    return mnist_dataset(root, True, download), mnist_dataset(root, False)


def build_loader(dataset: Dataset, sampler: ElasticDistributedSampler, num_workers: int = 0,
                 pin_memory: bool = False) -> DataLoader:
    """A DataLoader whose batches are the sampler's per-step shares, in step order.

    The sampler runs in this process (workers only load items), so `sampler.set_step` takes effect at
    the next `iter(loader)`; persistent workers spare a fork of every worker at each epoch and restart."""
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, not {num_workers}")
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                      persistent_workers=num_workers > 0)
