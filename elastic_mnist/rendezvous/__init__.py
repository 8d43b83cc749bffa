"""Rendezvous backends for torchrun; `etcd-v3` is registered through the package entry point.

    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=job1 ...

pyproject declares `[project.entry-points."torchrun.handlers"] etcd-v3 =
"elastic_mnist.rendezvous:handler_factory"`; torch's registry calls `handler_factory()` with no
arguments while `torch.distributed.elastic.rendezvous` is being imported, for every torchrun run,
whatever its backend. So this module imports neither torch nor grpc: the real work is imported on
first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousParameters

# Public names, resolved lazily (PEP 562) from their modules.
_EXPORTS = {
    "EtcdV3RendezvousBackend": "elastic_mnist.rendezvous.etcd_v3",
    "EtcdV3ConfigError": "elastic_mnist.rendezvous.etcd_v3",
    "EtcdV3ConnectionError": "elastic_mnist.rendezvous.etcd_v3",
    "EtcdV3StateError": "elastic_mnist.rendezvous.etcd_v3",
    "StateIntegrityError": "elastic_mnist.etcd.rdzv_state",
    "VALID_KEYS": "elastic_mnist.rendezvous.etcd_v3",
    "create_backend": "elastic_mnist.rendezvous.etcd_v3",
    "EtcdV3Store": "elastic_mnist.rendezvous.store",
    "EtcdV3Client": "elastic_mnist.etcd.client",
    "EtcdConnectionSpec": "elastic_mnist.etcd.client",
    "EtcdV3Error": "elastic_mnist.etcd.client",
    "read_rendezvous_status": "elastic_mnist.etcd.rdzv_status",
}
__all__ = ["handler_factory", "create_rdzv_handler", *_EXPORTS]


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """`(RendezvousParameters) -> RendezvousHandler` for --rdzv-backend=etcd-v3."""
    from elastic_mnist.rendezvous.etcd_v3 import create_rdzv_handler as create

    return create(params)


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The torchrun.handlers entry point: torch calls it with no arguments and registers the result."""
    return create_rdzv_handler


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
