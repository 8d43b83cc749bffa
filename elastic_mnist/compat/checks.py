"""How compat/private.py checks torch's internals: each check records what it covered and fails with one line
naming the torch version, the mismatch and the supported range. Public names only; the private ones are
reached in compat/private.py.

    python -m elastic_mnist.compat    # runs every check, prints what they covered
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable

import torch

from elastic_mnist.contract.errors import UserError

SUPPORTED = "torch 2.13-2.14"
RDZV = "dynamic rendezvous internals"
C10D = "c10d internals"
CHECKED: list[str] = []  # every name the checks covered, in order: what `python -m` prints


class TorchCompatError(ImportError, UserError):
    """The installed torch lacks an internal elastic-mnist relies on; the message is one line."""


def mismatch(what: str, problem: str) -> TorchCompatError:
    return TorchCompatError(f"elastic-mnist needs torch's {what}: torch {torch.__version__} {problem}; "
                            f"supported: {SUPPORTED}")


def require(owner, name: str, what: str = RDZV):
    """owner.name, or the one-line error. `owner` is a module or a class."""
    label = f"{getattr(owner, '__name__', owner)}.{name}"
    if not hasattr(owner, name):
        raise mismatch(what, f"has no {label}")
    CHECKED.append(label)
    return getattr(owner, name)


def field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's fields, else the class's annotated attributes (torch's _RendezvousState is not a
    dataclass: it annotates its attributes and sets them in __init__)."""
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    return tuple(inspect.get_annotations(cls))


def require_fields(cls: type, fields: Iterable[str], what: str = RDZV) -> None:
    have = set(field_names(cls))
    for name in fields:
        if name not in have:
            raise mismatch(what, f"has no field {cls.__name__}.{name}")
        CHECKED.append(f"{cls.__name__}.{name} (field)")


def require_params(func: Callable, params: tuple[str, ...], label: str, what: str = RDZV) -> None:
    """The signature starts with `params`, in that order: we pass them positionally."""
    try:
        names = tuple(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        raise mismatch(what, f"has no inspectable signature for {label}") from None
    if names[:len(params)] != params:
        raise mismatch(what, f"has {label}({', '.join(names)}), not ({', '.join(params)}, ...)")
    CHECKED.append(f"{label}({', '.join(params)})")


def require_in_code(func: Callable, names: Iterable[str], label: str, what: str = RDZV) -> None:
    """Each name is an attribute the function's code touches, or a string constant in it: how we know,
    without reading source files, that torch's __init__ still sets the attributes we reach into."""
    code = func.__code__
    for name in names:
        if name not in code.co_names and name not in code.co_consts:
            raise mismatch(what, f"no longer uses {name} in {label}")
        CHECKED.append(f"{label} uses {name}")
