"""The data: MNIST IDX decode and cache, the world-size-invariant batch plan, the elastic sampler and loader.

    python -c "from elastic_mnist.data import BatchPlan; print(BatchPlan(60000, 128, 0).rank_indices(5, 3, 1))"

The public names below are imported on first use: `elastic_mnist.data` alone imports nothing heavy.
"""

import importlib

_PUBLIC = {
    "BatchPlan": "elastic_mnist.data.mnist",
    "Split": "elastic_mnist.data.mnist",
    "load_split": "elastic_mnist.data.mnist",
    "ElasticDistributedSampler": "elastic_mnist.data.sampler",
    "build_loader": "elastic_mnist.data.loader",
    "mnist_datasets": "elastic_mnist.data.loader",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'elastic_mnist.data' has no attribute {name!r}")
