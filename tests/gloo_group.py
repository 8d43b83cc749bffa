"""Real processes in a real gloo group for in-process tests: `run_group(fn, world, *args)` spawns `world`
processes; each joins the group (FileStore rendezvous), runs `fn(rank, world, *args)` and leaves it."""

from __future__ import annotations

import os
import sys
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


def _member(rank: int, fn, world: int, store_path: str, args: tuple) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # Ended as the worker ends (worker/train.py launch): gloo's threads release a collective's tensors after
    # it has returned, and one that does so while the interpreter finalizes aborts the process (SIGABRT,
    # "terminate called without an active exception"). A failure above still reaches mp.spawn's error file.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_group(fn, world: int, *args) -> None:
    """Raise mp.spawn's error (with the failing rank's traceback) when any member fails."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_member, args=(fn, world, os.path.join(tmp, "store"), args), nprocs=world, join=True)
