"""Sharded data parallelism: torch's `fully_shard` (FSDP2) over one round's ranks, and the model's and the
optimizer's state as this rank's rows (FSDP2's dim-0 shards), the form state/reshard.py moves from one world
size to another in memory.

    python -m pytest tests/test_sharded.py -q     # a reshard after a kill equals a DCP save loaded at the new size

A round's model is wrapped for that round's mesh; at the next round a fresh copy of the task's model is
wrapped for the new mesh and takes its rows (`load_rows`). What a rank holds between rounds is what
`rows_of` returns (its own rows) and the copy of its ring neighbour's rows (state/sharded_sync.py's keeper).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from elastic_mnist.state.reshard import shard_rows
from elastic_mnist.worker.step import PRECISIONS


def mesh_of(group=None, device_type: str = "cpu", name: str = "shard") -> DeviceMesh:
    """The round's ranks (the default group, or `group`) as FSDP2's one-dimensional mesh. `name`: a mesh of
    the same ranks equals every earlier one of that name (whatever this rank was in it), and DTensor's caches
    hand out the earlier one: each round names its own (compat.forget_meshes clears them too)."""
    return DeviceMesh.from_group(group or dist.group.WORLD, device_type, mesh_dim_names=(name,))


def precision_policy(precision: str) -> MixedPrecisionPolicy:
    """--precision as FSDP2's policy: compute in bf16 or fp16, reduce gradients and keep the sharded
    parameters and the optimizer's state in fp32; fp32 changes nothing."""
    dtype = PRECISIONS[precision]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)


def shard_blocks(model: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> nn.Module:
    """The default wrapping (Task.shard): every direct child that holds parameters is its own unit (its
    parameters are gathered just before it runs and freed after), then the root for whatever is left."""
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def empty_sharded(build, mesh: DeviceMesh, policy: MixedPrecisionPolicy, device: torch.device,
                  shard=shard_blocks) -> nn.Module:
    """`build()`'s model wrapped for `mesh` without ever holding it whole: built on the meta device, sharded,
    then given uninitialized storage for this rank's rows only, which `load_rows` fills."""
    with torch.device("meta"):
        model = build()
    shard(model, mesh, policy)
    return model.to_empty(device=device)


def rows_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """(this rank's rows of every sharded tensor by name, the optimizer's unsharded per-parameter values such
    as Adam's step). Names: `model.<param>` and `optimizer.<param>.<key>`; the rows are views, not copies."""
    rows, replicated = {}, {}
    for name, p in model.named_parameters():
        rows[f"model.{name}"] = p.detach().to_local()  # no autograd history: it would hold the round's mesh
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, DTensor):
                rows[f"optimizer.{name}.{key}"] = value.to_local()
            else:
                replicated[f"{name}.{key}"] = value
    return rows, replicated


def specs_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The whole shape and dtype of every sharded tensor `rows_of` names, as meta tensors: each parameter's, and
    each of the optimizer's sharded values it holds now (Adam's moments, SGD's momentum, once they exist)."""
    specs = {}
    for name, p in model.named_parameters():
        specs[f"model.{name}"] = torch.empty(p.shape, dtype=p.dtype, device="meta")
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, DTensor):
                specs[f"optimizer.{name}.{key}"] = torch.empty(value.shape, dtype=value.dtype, device="meta")
    return specs


def load_rows(model: nn.Module, optimizer: torch.optim.Optimizer, rows: dict[str, torch.Tensor],
              replicated: dict) -> None:
    """Put this rank's rows into a model wrapped for the new mesh, and its optimizer's state beside them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(rows[f"model.{name}"])
    for name, p in model.named_parameters():
        prefix = f"optimizer.{name}."
        state = {k[len(prefix):]: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                                      shape=p.shape, stride=p.stride())
                 for k, v in rows.items() if k.startswith(prefix)}
        state.update({k[len(name) + 1:]: v.clone() if isinstance(v, torch.Tensor) else v
                      for k, v in replicated.items() if k.rsplit(".", 1)[0] == name})
        if state:
            optimizer.state[p] = state


SHARDED_OBJECTS = ("model", "optimizer")
"""The registered objects whose state is rows; every other one (scheduler, scaler, RNG, the task's own) every
rank of a round holds alike."""


def split_state(objects: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """A learner's whole state as (this rank's rows, the rest every rank holds alike): the rest is the model's
    buffers, the optimizer's per-parameter values that are not rows (Adam's step) and its groups' settings (the
    learning rate the scheduler set last), and every other registered object's state_dict()."""
    rows, scalars = rows_of(model, optimizer)
    names = {id(p): name for name, p in model.named_parameters()}
    groups = [{**group, "params": [names[id(p)] for p in group["params"]]} for group in optimizer.param_groups]
    rest = {name: obj.state_dict() for name, obj in objects.items() if name not in SHARDED_OBJECTS}
    return rows, {**rest, "model": {"buffers": _buffers(model.state_dict(), model)},
                  "optimizer": {"per_parameter": scalars, "groups": groups}}


def _buffers(model_state: dict, model: nn.Module) -> dict:
    """The model's persistent buffers (a BatchNorm's running statistics), which fully_shard leaves whole: by the
    model's buffer names, so a weight tied under two names stays a parameter."""
    return {name: model_state[name] for name, _ in model.named_buffers() if name in model_state}


def load_state(objects: dict, model: nn.Module, optimizer: torch.optim.Optimizer, rows: dict, rest: dict) -> None:
    """`split_state`'s inverse, into a learner wrapped for the new mesh (its objects built afresh)."""
    load_rows(model, optimizer, rows, rest["optimizer"]["per_parameter"])
    with torch.no_grad():
        for name, value in rest["model"]["buffers"].items():
            model.get_buffer(name).copy_(value)
    for group, saved in zip(optimizer.param_groups, rest["optimizer"]["groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    for name, obj in objects.items():
        if name not in SHARDED_OBJECTS:
            obj.load_state_dict(rest[name])


def from_whole(state: dict, model: nn.Module, optimizer: torch.optim.Optimizer, world: int, rank: int
               ) -> tuple[dict, dict]:
    """A replicated run's state (a DDP checkpoint: whole "model" and "optimizer" state dicts) as `split_state`
    gives it to `rank` of `world`, for `load_state` into a learner wrapped for that mesh (`model`, `optimizer`
    name the parameters: the optimizer's state is by position, as its groups list them)."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    rows, per_parameter = {}, {}
    for name in names.values():
        whole = state["model"][name]
        a, b = shard_rows(whole.shape[0], world, rank)
        rows[f"model.{name}"] = whole[a:b]
    for index, name in enumerate(order):
        for key, value in state["optimizer"]["state"].get(index, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == state["model"][name].shape and value.dim():
                a, b = shard_rows(value.shape[0], world, rank)
                rows[f"optimizer.{name}.{key}"] = value[a:b]
            else:
                per_parameter[f"{name}.{key}"] = value
    groups = [{**group, "params": [order[i] for i in group["params"]]} for group in state["optimizer"]["param_groups"]]
    rest = {name: value for name, value in state.items() if name not in SHARDED_OBJECTS}
    return rows, {**rest, "model": {"buffers": _buffers(state["model"], model)},
                  "optimizer": {"per_parameter": per_parameter, "groups": groups}}


class ShardedParallel:
    """parallel.DataParallel's counterpart for a model `fully_shard` wrapped (worker/step.py's replicas):
    FSDP2 reduce-scatters the gradient in backward, divided by the world size as DDP's all-reduce is, so
    every rank's .grad holds its rows of the gradient averaged over the ranks once backward returns."""

    uses_ddp = False
    collective_forward = True

    def __init__(self, model: nn.Module, world_size: int) -> None:
        self.module, self.world_size = model, world_size

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward without the reduce-scatter (gradient accumulation's early micro-batches): FSDP2 keeps the
        unsharded gradient until the last micro-batch's backward reduces the sum."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def average_gradients(self) -> None:
        """Done in backward."""


class ShardedState:
    """A round's sharded learner as its checkpoint manager sees it: this rank's rows and the rest (split_state),
    loaded from whatever the round agreed on (rows moved in memory, a sharded checkpoint, a replicated run's
    state, or the task's freshly built model). `objects`: every registered object, "progress" included."""

    def __init__(self, objects: dict, model: nn.Module, optimizer: torch.optim.Optimizer, initial) -> None:
        self.objects, self.model, self.optimizer, self.initial = objects, model, optimizer, initial
        mesh = next(model.parameters()).device_mesh
        self.rank, self.world = mesh.get_local_rank(), mesh.size()

    def split(self) -> tuple[dict, dict]:
        return split_state(self.objects, self.model, self.optimizer)

    def specs(self) -> dict[str, torch.Tensor]:
        return specs_of(self.model, self.optimizer)

    def load(self, rows: dict, rest: dict) -> None:
        load_state(self.objects, self.model, self.optimizer, rows, rest)

    def load_replicated(self, state: dict) -> None:
        """A replicated run's state (a DDP checkpoint), this rank's rows of it."""
        self.load(*from_whole(state, self.model, self.optimizer, self.world, self.rank))

    def load_initial(self) -> None:
        """A fresh run: the task's model as every rank builds it (seeded), this rank's rows of it."""
        whole = self.initial().state_dict()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                a, b = shard_rows(p.shape[0], self.world, self.rank)
                p.to_local().copy_(whole[name][a:b])
            for name, value in _buffers(whole, self.model).items():
                self.model.get_buffer(name).copy_(value)

    def saved(self) -> dict:
        """What a sharded checkpoint's DCP part holds, by the names `get_state_dict` flattens to."""
        out = {}
        for name, p in self.model.named_parameters():
            out[f"model.{name}"] = p
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, DTensor):
                    out[f"optim.state.{name}.{key}"] = value
        return out

    def rows_for(self, listed: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        """(empty rows for this rank of what a sharded checkpoint lists, the same rows as DTensors for DCP to
        load into): `load` takes the rows once DCP filled them."""
        params = dict(self.model.named_parameters())
        rows, views = {}, {}
        for saved_name in listed:
            kind, _, rest = saved_name.partition(".")
            name = rest if kind == "model" else rest.removeprefix("state.").rsplit(".", 1)[0]
            p = params[name]
            local = torch.empty_like(p.to_local(), dtype=listed[saved_name].dtype)
            rows["model." + rest if kind == "model" else "optimizer." + rest.removeprefix("state.")] = local
            views[saved_name] = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                                   shape=p.shape, stride=p.stride())
        return rows, views
