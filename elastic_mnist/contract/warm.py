"""How a torchrun agent starts its warm process and hears from it: the module it runs, where it listens, the
progress marks it writes, and the worker it may build before its round (WorkerPlan).

    python -c "from elastic_mnist.contract.warm import WorkerPlan; print(WorkerPlan({'module': 'm'}, [], '/', 1))"

The agent's side is rendezvous/_warm_start.py, the warm process's warm/server.py; neither imports the other.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

SERVER_MODULE = "elastic_mnist.warm.server"  # `python -m` this, with the flags warm/server.py declares
TRAIN_MODULE = "elastic_mnist.train"  # the package's own worker: its flags can be checked before it starts
SOCKET_NAME = "warm.sock"
MAX_PATH = 100  # sun_path holds 108 bytes: a longer agent directory gets no warm process
PROBE_TIMEOUT_S = 20.0  # how long a probe child may take to prove a fork of the warm process runs torch
# One byte each on the agent's pipe: listening, warm (torch imported, a fork proven safe), ready (each local
# rank's worker built before its round), failed (such a worker ended first).
LISTENING, WARM, READY, FAILED = b"1", b"2", b"3", b"x"


def address_in(directory: str) -> str:
    return os.path.join(directory, SOCKET_NAME)


@dataclass(frozen=True)
class WorkerPlan:
    """The worker a torchrun agent will start, as its command line says (its warm process may build it first)."""

    target: dict
    """{"module": name} or {"path": absolute script path}, as a stand-in's request names it."""
    args: list
    cwd: str
    local_world_size: int

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> WorkerPlan:
        return cls(dict(data["target"]), list(data["args"]), str(data["cwd"]), int(data["local_world_size"]))
