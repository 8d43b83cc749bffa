"""The training state as a registry of objects with `state_dict()` / `load_state_dict()` (torch's
Stateful idea): the model, the optimizer, the LR scheduler, the GradScaler, the RNG (CPU and every CUDA
device), the progress counters and whatever a Task adds (`Task.extra_state`: an EMA, a counter), each
under its name. The checkpoint manager saves and restores whatever is registered; it never assembles
state by hand. A checkpoint records the names it holds, so one of another set of objects is refused.

    python -c "from elastic_mnist.state.registry import Progress; p = Progress(); print(p.state_dict())"
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Protocol

import torch

from elastic_mnist.contract.errors import UserError


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class Progress:
    """What survives restarts besides the learned state. One object per process, created once and loaded in
    place, so every holder (the trainer, the manager) sees the same counters."""

    step: int = 0
    """Optimizer steps completed; the checkpoint's identity (its file name) and the data position."""
    resumes: int = 0
    train_time_s: float = 0.0
    samples_per_s: float = 0.0
    """Steady-state throughput of the latest (re)start that trained enough steps to measure it."""
    last_eval: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        # The step is stored once, beside the payload (every reader of a checkpoint needs it).
        return {k: v for k, v in asdict(self).items() if k != "step"}

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])


class RngState:
    """The CPU generator and, where CUDA is initialized, every device's generator, so a resumed run draws
    what an uninterrupted one would (dropout, random augmentation). It seeds them with `seed` when created
    and again (`reset`) just before a process's first restore: a fresh run starts from the same RNG state
    however much the start-up drew (the process group's set-up does, a varying amount); a resume then loads
    the saved state over it."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        """The generators as a fresh run starts them (CPU and, lazily, every CUDA device)."""
        torch.manual_seed(self.seed)

    def state_dict(self) -> dict:
        state = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # never initializes CUDA itself
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        cuda = state.get("cuda") or []
        if cuda and torch.cuda.is_available():
            # A node with fewer devices than the saver restores the ones it has.
            for device, rng in enumerate(cuda[:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(rng, device)


OBJECTS_KEY = "objects"
"""The checkpoint key that lists the registered names it holds state for."""


def load_into(objects: dict[str, Stateful], state: dict, source: str) -> None:
    """Every registered object from its part of `state`; a state of another set of objects (one missing,
    or one more that this run would drop) is refused before any is loaded: it must not half-load."""
    saved = set(state.get(OBJECTS_KEY, [k for k in state if k in objects]))
    missing, extra = sorted(set(objects) - saved - {k for k in state if k in objects}), sorted(saved - set(objects))
    if missing or extra:
        parts = ([f"holds no state for {', '.join(missing)}"] if missing else []) + (
            [f"holds state for {', '.join(extra)} that this run does not register"] if extra else [])
        raise UserError(f"checkpoint {source} {' and '.join(parts)} (it has {', '.join(sorted(saved))}; this run "
                        f"registers {', '.join(sorted(objects))}): it was saved by another task or another "
                        "Task.extra_state. Use a different --checkpoint-dir for this one, or the task that wrote "
                        "it (nothing was deleted)")
    for name, obj in objects.items():
        obj.load_state_dict(state[name])


def map_tensors(obj, fn):
    """obj with fn applied to every tensor in its nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def cpu_snapshot(obj):
    """Deep copy of tensors to CPU so a background thread can serialize while training mutates them."""
    return map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))


def leaves(tree) -> list[torch.Tensor]:
    """The tensors of a nested dict/list, in a stable order (state_dict order)."""
    found: list[torch.Tensor] = []
    map_tensors(tree, found.append)
    return found

