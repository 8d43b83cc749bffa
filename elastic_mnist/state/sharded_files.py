"""Checkpoints of a sharded run: every rank's rows through torch.distributed.checkpoint (DCP), and beside them
one checkpoint file of ours, whose publishing makes the step exist.

    python -m pytest tests/test_sharded_files.py -q    # saved at world 3; loaded at world 2, and by one process

`ckpt-{step:09d}.pt` is an ordinary checkpoint file (format.py: checksum or keyed digest, no-clobber publish)
holding everything but the sharded tensors, and under SHARDS_KEY the name of the directory DCP wrote them to,
`ckpt-{step:09d}.shards/`, with the sha256 of every file in it. The directory is written under a temp name
and renamed before the file is published, so a step exists only once both are complete, and a file that
verifies vouches for every byte of its shards. DCP reshards on load: at any world size, or whole tensors in
one process (`load_whole`: a sharded checkpoint read by a run that does not shard).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from elastic_mnist import files
from elastic_mnist.state import format as checkpoint
from elastic_mnist.state.sync import broadcast_bytes

SHARDS_KEY = checkpoint.SHARDS_KEY


def shards_dir(directory: str, step: int) -> str:
    return checkpoint.shards_of(checkpoint.path_for(directory, step))


def save(directory: str, step: int, sharded: dict, state: dict, key: bytes | None = None, group=None) -> bool:
    """Collective over `group`: DCP writes every rank's rows of `sharded` (a state dict of DTensors), then
    global rank 0 of the group publishes the checkpoint file of `state` (the rest: step, progress, config).
    True on every rank when this call published the step; False when it existed already (left as it was);
    OSError on every rank when the volume could not take it (DCP raises its write errors on every rank too)."""
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{TEMP_PREFIX}{step:09d}.shards.tmp-{_shared_token(group)}")
    dcp.save(sharded, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), process_group=group)
    outcome = b""
    if dist.get_rank(group) == 0:
        try:
            outcome = b"1" if _publish(directory, step, tmp, state, key) else b"0"
        except OSError as e:  # a full or read-only volume: every rank must learn it, none waits for the publish
            outcome = b"!" + str(e).encode()[:500]
    outcome = broadcast_bytes(outcome, 0, group)
    if outcome.startswith(b"!"):
        raise OSError(outcome[1:].decode(errors="replace"))
    return outcome == b"1"


def _publish(directory: str, step: int, tmp: str, state: dict, key: bytes | None) -> bool:
    path, final = checkpoint.path_for(directory, step), shards_dir(directory, step)
    if os.path.lexists(path):
        shutil.rmtree(tmp)  # another writer completed this step first: its copy stays
        return False
    digests = {name: files.sha256_of(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
    if os.path.isdir(final) and not os.path.islink(final):
        shutil.rmtree(final)  # a writer that died between its rename and its publish: never published
    os.rename(tmp, final)
    files.fsync_dir(directory)
    blob = checkpoint.encode({**state, "step": step, SHARDS_KEY: {"dir": os.path.basename(final), "files": digests}},
                             key)
    return checkpoint.write_durable(path, blob)


def _shared_token(group) -> str:
    """Rank 0's random token, so every rank writes into the same temp directory (from the OS: drawing from
    torch's RNG would change what training draws after a save)."""
    return broadcast_bytes(os.urandom(8).hex().encode() if dist.get_rank(group) == 0 else b"", 0, group).decode()


TEMP_PREFIX = ".ckpt-"
"""How the temp directory of a save in progress begins (`.ckpt-STEP.shards.tmp-TOKEN`)."""


def sweep_temps(directory: str, min_age_s: float) -> None:
    """The temp directories of saves whose writers were killed (older than `min_age_s`: not a live save's)."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(TEMP_PREFIX) and ".shards.tmp-" in n]
    except OSError:
        return
    for name in names:
        where = os.path.join(directory, name)
        try:
            old = time.time() - os.stat(where).st_mtime >= min_age_s
        except OSError:
            continue
        if old and os.path.isdir(where) and not os.path.islink(where):
            shutil.rmtree(where, ignore_errors=True)


def verified_dir(directory: str, state: dict) -> str:
    """The shards directory of a decoded sharded checkpoint, once every file in it matches its sha256 (and
    none is missing or added); CheckpointError otherwise, with nothing read by DCP."""
    listed = state[SHARDS_KEY]
    where = os.path.join(directory, listed["dir"])
    if os.path.basename(where) != os.path.basename(shards_dir(directory, state["step"])) or not os.path.isdir(where):
        raise checkpoint.CheckpointError(f"{where}: the shards of step {state['step']} are missing")
    found = sorted(os.listdir(where))
    if found != sorted(listed["files"]):
        raise checkpoint.CheckpointError(f"{where}: holds {found}, its checkpoint lists {sorted(listed['files'])}")
    for name, digest in listed["files"].items():
        if files.sha256_of(os.path.join(where, name)) != digest:
            raise checkpoint.CheckpointError(f"{where}/{name}: checksum mismatch (truncated or corrupt)")
    return where


def load(directory: str, state: dict, sharded: dict, group=None) -> None:
    """Collective: DCP loads the verified shards into `sharded` (DTensors of this round's mesh), in place."""
    dcp.load(sharded, storage_reader=dcp.FileSystemReader(verified_dir(directory, state)), process_group=group)


def shards_problem(directory: str, state: dict, world: int) -> str:
    """Collective (world > 1): why the shards of a decoded sharded checkpoint do not verify ("" when they do),
    as rank 0 found it (one rank reads them; the directory is every rank's)."""
    problem = ""
    if world == 1 or dist.get_rank() == 0:
        try:
            verified_dir(directory, state)
        except checkpoint.CheckpointError as e:
            problem = str(e)
    return problem if world == 1 else broadcast_bytes(problem.encode(), 0).decode()


def load_listed(directory: str, state: dict, make: Callable[[dict[str, torch.Tensor]], dict], group=None) -> None:
    """Collective: DCP loads the shards (`shards_problem` found none) into `make(specs)`, the DTensors of this
    round's mesh built for the tensors the checkpoint lists (`specs`: each one whole, as a meta tensor)."""
    where = shards_dir(directory, state["step"])
    sharded = make(_listed(dcp.FileSystemReader(where)))
    dcp.load(sharded, storage_reader=dcp.FileSystemReader(where), process_group=group)


def load_whole(directory: str, state: dict) -> dict[str, torch.Tensor]:
    """Every sharded tensor whole, read by this process alone (no process group)."""
    reader = dcp.FileSystemReader(verified_dir(directory, state))
    whole = {name: torch.empty(m.shape, dtype=m.dtype) for name, m in _listed(reader).items()}
    dcp.load(whole, storage_reader=reader, no_dist=True)
    return whole


def _listed(reader) -> dict[str, torch.Tensor]:
    meta = reader.read_metadata().state_dict_metadata
    return {name: torch.empty(m.size, dtype=m.properties.dtype, device="meta") for name, m in meta.items()
            if hasattr(m, "size")}


def remove(directory: str, step: int) -> None:
    """The shards of a step whose checkpoint file keep-k removed."""
    where = shards_dir(directory, step)
    if os.path.isdir(where) and not os.path.islink(where):
        shutil.rmtree(where)


def read_whole(directory: str, state: dict) -> dict:
    """A sharded checkpoint (its decoded file `state`) as a replicated run's state, read by this process alone."""
    return to_whole(load_whole(directory, state), state)


_SHARDED = ("model", "optimizer")  # the objects whose state a sharded checkpoint holds as rows


def to_whole(whole: dict[str, torch.Tensor], rest: dict) -> dict:
    """`from_whole`'s inverse: a sharded checkpoint read whole (`load_whole` of a DCP save of
    `get_state_dict`: `model.<param>`, `optim.state.<param>.<key>`) with its rest (`split_state`'s) as a
    replicated run's state, whose "model" and "optimizer" load into a model that is not sharded."""
    groups = rest["optimizer"]["groups"]
    order = [name for group in groups for name in group["params"]]
    state = {}
    for index, name in enumerate(order):
        prefix = f"optim.state.{name}."
        held = {k[len(prefix):]: v for k, v in whole.items() if k.startswith(prefix)}
        held.update({k[len(name) + 1:]: v for k, v in rest["optimizer"]["per_parameter"].items()
                     if k.rsplit(".", 1)[0] == name})
        if held:
            state[index] = held
    model = {**rest["model"]["buffers"], **{k[len("model."):]: v for k, v in whole.items() if k.startswith("model.")}}
    param_groups = [{**group, "params": [order.index(n) for n in group["params"]]} for group in groups]
    others = {k: v for k, v in rest.items() if k not in _SHARDED}
    return {**others, "model": model, "optimizer": {"state": state, "param_groups": param_groups}}
