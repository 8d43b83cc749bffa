"""One place for torch's private API: every private torch name elastic-mnist uses, checked when imported.

    python -m elastic_mnist.compat    # prints each checked name, then OK (or the one mismatch)

elastic-mnist builds on internals torch does not promise to keep: the dynamic rendezvous handler's op
executor, state holder and state classes (rendezvous/_prompt.py, _leave.py, etcd_v3.py), the names torch's
C++ Store trampoline dispatches to (rendezvous/store.py), the default store and a hand-built gloo group
(worker/control.py), the NCCL abort (distributed.py) and torch._foreach_copy_ (state/manager.py). They are
reached here and nowhere else (tests/test_torch_compat.py enforces it), and checked at import: a torch whose
internals moved fails with ONE line naming its version and the mismatch, not with a rendezvous that
silently misbehaves (the checks: compat/checks.py). The pickled state classes are checked against the
torch-free stand-ins of etcd/rdzv_state.py by `check_pickled_classes`, which etcd_v3.py runs on import.

The checks are cheap (hasattr, annotations, signatures, names in code objects, one in-memory PrefixStore):
workers import this module and must start fast; it imports nothing they did not (no torch._dynamo, no etcd).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import sys
from types import ModuleType

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from elastic_mnist.compat.checks import C10D as _C10D
from elastic_mnist.compat.checks import (  # noqa: F401 (the checks)
    CHECKED,
    SUPPORTED,
    TorchCompatError,
    field_names,
    mismatch,
    require,
    require_fields,
    require_in_code,
    require_params,
)
from elastic_mnist.compat.checks import RDZV as _RDZV

log = logging.getLogger(__name__)


# -- the dynamic rendezvous handler (rendezvous/_prompt.py, _leave.py, etcd_v3.py) ---------------------------
# Public name here -> torch's name in dynamic_rendezvous. Loaded on first use (PEP 562 __getattr__ below):
# importing torch's rendezvous package scans entry points, ~40 ms that workers, which never rendezvous, skip.
_RDZV_EXPORTS = {
    "Action": "_Action", "RendezvousContext": "_RendezvousContext", "RendezvousExitOp": "_RendezvousExitOp",
    "RendezvousJoinOp": "_RendezvousJoinOp",
    "BackendRendezvousStateHolder": "_BackendRendezvousStateHolder",
    "DistributedRendezvousOpExecutor": "_DistributedRendezvousOpExecutor",
    "DynamicRendezvousHandler": "DynamicRendezvousHandler",
}
# Read by torch's next_rendezvous: "1" makes each round's workers start from a fresh store.
DISABLE_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def fresh_worker_store(env):
    """Turn torch's stale-store guard on in env (an agent's os.environ, or a child's env); a value the user
    set still wins. Returns env. Root cause of torch's shared-store restart hangs (pytorch/pytorch#135712):
    by default rank 0's agent hosts one TCPStore for its workers that outlives rendezvous rounds, and
    gloo's keys in it keep their names from round to round, so a new worker can read a dead peer's
    address and dial it; with the guard every round's workers start from a fresh store."""
    env.setdefault(DISABLE_SHARED_STORE_ENV, "1")
    return env
_HANDLER_ATTRS = ("_this_node", "_settings", "_state_holder", "_op_executor")


@functools.cache
def _rendezvous() -> ModuleType:
    """torch's dynamic_rendezvous, imported and checked once; its classes become this module's globals."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    globals().update({ours: require(dynamic_rendezvous, theirs) for ours, theirs in _RDZV_EXPORTS.items()})
    _check_rendezvous()
    return dynamic_rendezvous


ROUND_PREFIX = "torch.rendezvous."  # DynamicRendezvousHandler._wrap_store: each round's keys in the job store


def round_store_prefix(run_id: str, round_: int) -> str:
    """Where torch's agent keeps round `round_`'s keys in the rendezvous store (checked with the handler)."""
    return f"{ROUND_PREFIX}{run_id}.{round_}/"


@functools.cache
def exit_barrier_key() -> str:
    """The key torch's agents set in a round's store as the last one leaves the exit barrier, as torch names it
    (agent/server/api.py's _TERMINAL_STATE_SYNC_ID + utils/store.py's _LAST_MEMBER_CHECKIN)."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.utils import store

    return require(api, "_TERMINAL_STATE_SYNC_ID") + require(store, "_LAST_MEMBER_CHECKIN")


def __getattr__(name: str):
    if name in _RDZV_EXPORTS:
        _rendezvous()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_rendezvous() -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    g = globals()
    for member in ("SYNC", "FINISH"):
        require(g["Action"], member)
    require_params(g["RendezvousContext"], ("node", "state", "settings"), "_RendezvousContext")
    require_params(g["RendezvousExitOp"].__call__, ("self", "ctx", "deadline"), "_RendezvousExitOp.__call__")
    holder = g["BackendRendezvousStateHolder"]
    require_params(holder, ("backend", "settings", "cache_duration"), "_BackendRendezvousStateHolder")
    for member in ("sync", "state"):
        require(holder, member)
    executor = g["DistributedRendezvousOpExecutor"]
    require_params(executor, ("node", "state_holder", "settings"), "_DistributedRendezvousOpExecutor")
    require_params(executor.run, ("self", "state_handler", "deadline", "update_deadline"),
                   "_DistributedRendezvousOpExecutor.run")
    require(executor, "_remove_from_participants")
    # PromptOpExecutor reads these of its torch base class (as self._x).
    require_in_code(executor.__init__, ("_node", "_state_holder", "_settings"), "_DistributedRendezvousOpExecutor")
    require_in_code(executor.run, ("_state",), "_DistributedRendezvousOpExecutor.run")
    handler = g["DynamicRendezvousHandler"]
    require(handler, "_stop_heartbeats")
    require_in_code(handler.__init__, _HANDLER_ATTRS, "DynamicRendezvousHandler")
    require_in_code(handler.next_rendezvous, (DISABLE_SHARED_STORE_ENV,), "DynamicRendezvousHandler.next_rendezvous")
    require_in_code(require(handler, "_wrap_store"), (ROUND_PREFIX,), "DynamicRendezvousHandler._wrap_store")
    # with_tuned_defaults rebuilds the parameters positionally.
    require_params(RendezvousParameters, ("backend", "endpoint", "run_id", "min_nodes", "max_nodes", "local_addr"),
                   "RendezvousParameters")


def check_pickled_classes(allowed: dict[tuple[str, str], type]) -> None:
    """Each torch class the state unpickler admits (by module path and name) is where the pickle names it,
    with every field of our stand-in: a state torch writes is one that etcd/rdzv_state.py decodes."""
    for (module, name), stand_in in allowed.items():
        if not module.startswith("torch"):
            continue
        dyn = _rendezvous()
        cls = require(dyn, name) if module == dyn.__name__ else None
        if cls is None or (cls.__module__, cls.__qualname__) != (module, name):
            raise mismatch(_RDZV, f"pickles no {module}.{name}")
        require_fields(cls, field_names(stand_in))


@contextlib.contextmanager
def without_first_join_delay():
    """torch's next_rendezvous waits a random 0-0.3 s while the state it holds says round 0, to spread a cold
    start's first writes; a node re-joining after round 0 formed (its workers restarted) has nothing to spread,
    and those tenths of a second are a membership change's. Only for the call it wraps."""
    module = _rendezvous()
    saved = require(module, "_delay")
    module._delay = _no_delay
    try:
        yield
    finally:
        module._delay = saved


def _no_delay(seconds) -> None:
    return None


def quick_event_names() -> None:
    """torch's rendezvous names every event it records after the method recording it, by calling
    inspect.stack() twice, before it looks whether anything listens. inspect.stack() reads each frame's
    source and scans sys.modules for it: 50-130 ms a call in a torchrun agent on a 2-core CPU, eight calls
    and 0.8 s of the 0.85 s rendezvous that follows a kill. The same name, read from the frame itself."""
    module = _rendezvous()
    require(module, "get_method_name")
    require_in_code(module.DynamicRendezvousHandler._record, ("get_method_name",), "DynamicRendezvousHandler._record")
    module.get_method_name = _method_name


def _method_name(depth: int = 2) -> str:
    # inspect.stack()[0] is get_method_name's own frame, as sys._getframe(0) is this one's.
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a shallower stack, as torch answers it
        return "no_method_name"


def handler_node(handler):
    """The handler's _NodeDesc: the node name torch's state uses."""
    return handler._this_node


def handler_settings(handler):
    return handler._settings


def handler_state_holder(handler):
    return handler._state_holder


def set_state_holder(handler, holder) -> None:
    handler._state_holder = holder


def handler_op_executor(handler):
    return handler._op_executor


def set_op_executor(handler, executor) -> None:
    handler._op_executor = executor


def stop_heartbeats(handler) -> None:
    """torch's handler has no public way to leave: stop its keep-alive timer before we do."""
    handler._stop_heartbeats()


# -- c10d (worker/control.py, distributed.py, state/manager.py) ------------------------------------------------
default_store = require(_c10d, "_get_default_store", _C10D)
foreach_copy_ = require(torch, "_foreach_copy_", _C10D)
_abort = getattr(_c10d, "_abort_process_group", None)  # experimental in torch: optional, see abort_process_group
_abort_missing_said = False


def _check_c10d() -> None:
    require_params(default_store, (), "_get_default_store")
    gloo = require(dist, "ProcessGroupGloo", _C10D)
    # A pybind constructor has no signature, only its docstring's overloads.
    if "timeout: datetime.timedelta" not in (gloo.__init__.__doc__ or ""):
        raise mismatch(_C10D, "has no ProcessGroupGloo(store, rank, size, timeout: timedelta)")
    CHECKED.append("ProcessGroupGloo(store, rank, size, timeout)")
    if _abort is not None:
        require_params(_abort, ("group",), "_abort_process_group", _C10D)
    if not hasattr(dist, "set_timeout"):  # torch 2.13
        require_params(require(_c10d, "_set_pg_timeout", _C10D), ("timeout",), "_set_pg_timeout", _C10D)


_bad_fork = require(torch.cuda, "_is_in_bad_fork", "CUDA fork guard")


def cuda_bad_fork() -> bool:
    """Whether this process is a fork of one that initialised CUDA (it cannot use CUDA; warm/probe.py)."""
    return bool(_bad_fork())


def gloo_group(store: dist.Store, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s))


def set_group_timeout(timeout_s: float) -> None:
    """The default group's timeout for every later collective (it was created with a shorter one, the bound
    on forming it). Public in torch 2.14 (dist.set_timeout); 2.13 has only the private _set_pg_timeout."""
    setter = getattr(dist, "set_timeout", None) or _c10d._set_pg_timeout
    setter(datetime.timedelta(seconds=timeout_s))


def abort_process_group() -> bool:
    """Abort every process group (torch's experimental _abort_process_group); False, said once, where this
    torch has none. Raises what torch raises (RuntimeError, ValueError) for a group it cannot abort."""
    global _abort_missing_said
    if _abort is None:
        if not _abort_missing_said:
            _abort_missing_said = True
            log.warning("torch %s has no _abort_process_group: a collective blocked on a lost peer waits for "
                        "its timeout", torch.__version__)
        return False
    _abort()
    return True


def import_sharding() -> None:
    """What sharded training imports on first use: FSDP2 and DTensor, and torch._dynamo, which the first
    fully_shard imports through torch._disable_dynamo (most of a second). Called by a worker that trains
    sharded before its node joins, so no round waits for it."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401


def forget_meshes() -> None:
    """DTensor's caches keep every mesh they met (its sharding propagation, its redistribution plans, its
    topology), and a mesh equals an earlier one of the same ranks whatever this process's rank in it was: a later
    round of sharded training would be handed the earlier round's mesh (its offsets), and every round's process
    group would live on through its mesh (a thread, a socket and file descriptors each). A round's meshes go
    when its groups do. Checked when first called: only sharded training imports DTensor (a cost other workers
    skip)."""
    if "torch.distributed.tensor" in sys.modules:
        for clear in _sharding_caches():
            clear()


@functools.cache
def _sharding_caches() -> tuple:
    """Each cache of DTensor's that keeps the meshes it met, as the function that empties it."""
    import torch.distributed.tensor._collective_utils as collective
    import torch.distributed.tensor._redistribute as redistribute

    tensor, what = sys.modules["torch.distributed.tensor"], "DTensor's caches of meshes"
    prop = require(require(require(tensor, "DTensor", what), "_op_dispatcher", what), "sharding_propagator", what)
    return (*(require(require(prop, name, what), "cache_clear", what)
              for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached")),
            require(require(redistribute, "_gen_transform_infos", what), "cache_clear", what),
            require(require(redistribute, "_planner_cache", what), "clear", what),
            require(require(require(collective, "MeshTopoInfo", what), "build_from_mesh", what), "cache_clear", what),
            # The C++ dispatch's own cache of the same (torch 2.14; 2.13 dispatches DTensor in Python only).
            *[c for c in (getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),) if c])


# -- the C++ Store trampoline (rendezvous/store.py) ------------------------------------------------------------
# A Python Store reached through a C++ PrefixStore (what torchrun's agent hands around) is called by these
# C++ names for some operations, by its Python names for the others.
CPP_STORE_NAMES = {"getNumKeys": "num_keys", "deleteKey": "delete_key"}


def with_cpp_store_names(cls: type) -> type:
    """Class decorator: the C++ spellings the trampoline dispatches to, as aliases of the Python methods."""
    for cpp_name, py_name in CPP_STORE_NAMES.items():
        setattr(cls, cpp_name, getattr(cls, py_name))
    return cls


def _check_store_trampoline() -> None:
    @with_cpp_store_names
    class Probe(dist.Store):
        def num_keys(self) -> int:
            return 7

        def delete_key(self, key: str) -> bool:
            return key == "p/k"

    probe = Probe()  # kept referenced: a PrefixStore does not keep a Python store alive
    prefixed = dist.PrefixStore("p", probe)
    try:
        reached = prefixed.num_keys() == 7 and prefixed.delete_key("k")
    except RuntimeError:  # "Tried to call pure virtual function": dispatched to a name we do not define
        reached = False
    if not reached:
        raise mismatch("C++ Store trampoline", f"dispatches to none of {', '.join(CPP_STORE_NAMES)}")
    CHECKED.append(f"Store trampoline -> {', '.join(CPP_STORE_NAMES)}")


_check_c10d()
_check_store_trampoline()


def main() -> None:
    """Every check but the pickled state classes' (rendezvous/etcd_v3.py runs that one at its import: this
    module sits below the rendezvous package and never imports it)."""
    _rendezvous()
    for name in CHECKED:
        print(name)
    optional = "" if _abort is not None else " (no _abort_process_group: aborting is a no-op)"
    print(f"OK: torch {torch.__version__}{optional}")


if __name__ == "__main__":
    main()
