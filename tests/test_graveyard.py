"""A worker kept across rounds lets go of a given-up round's groups as soon as nothing of it is in flight:
real gloo groups in real processes, a peer that dies and a peer that does not answer yet."""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_mnist.graveyard import Graveyard, drained
from elastic_mnist.usage import usage


def _gloo(store, rank: int) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore("g", store), rank, 2, datetime.timedelta(seconds=30))


def _member(rank: int, store_path: str, case: str, results: str) -> None:
    store = dist.FileStore(store_path, 2)
    group = _gloo(store, rank)
    group.allreduce([torch.ones(2)]).wait()
    if rank == 1:
        if case == "late":  # answers only once rank 0 has seen its collective held
            store.wait(["held"])
            group.allreduce([torch.ones(2)]).wait()
        sys.stdout.flush()
        os._exit(0)
    graves, work = Graveyard(), group.allreduce([torch.ones(2)])
    graves.bury(work)
    graves.bury(group)
    if case == "late":
        graves.reap()
        assert len(graves) == 2, "a round whose collective still waits on a peer is kept"
        store.set("held", b"1")
        work.wait()
    else:
        try:
            work.wait()
        except RuntimeError:
            pass  # the dead peer's reset: the collective ended with an error
    ref, before = weakref.ref(group), usage()["thread_kinds"].get("pt_gloo_runloop", 0)
    del group, work
    graves.reap()
    assert len(graves) == 0 and drained()
    after = usage()["thread_kinds"].get("pt_gloo_runloop", 0)
    with open(results, "w") as f:
        f.write(f"{ref() is None} {before} {after}")
    sys.stdout.flush()
    os._exit(0)


def _run(case: str) -> tuple[bool, int, int]:
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results")
        mp.spawn(_member, args=(os.path.join(tmp, "store"), case, results), nprocs=2, join=True)
        freed, before, after = open(results).read().split()
    return freed == "True", int(before), int(after)


def test_a_round_lost_to_a_killed_peer_is_let_go_at_once():
    freed, before, after = _run("dead")
    assert freed and before > 0 and after == 0


def test_a_round_whose_collective_still_waits_is_kept_until_it_ends():
    freed, before, after = _run("late")
    assert freed and before > 0 and after == 0


def test_the_oldest_held_round_is_timed_from_its_burial(monkeypatch):
    """The soak judges holds by this age: kills closer together than the timeout overlap their holds."""
    clock = [100.0]
    monkeypatch.setattr("elastic_mnist.graveyard.time.monotonic", lambda: clock[0])
    graves = Graveyard()
    assert graves.oldest_s() == 0.0
    graves.bury(object())
    clock[0], graves.round = 130.0, 1
    graves.bury(object())
    clock[0] = 140.0
    assert graves.oldest_s() == 40.0 and len(graves) == 2
    graves.reap()  # nothing of either is in flight: both go
    assert graves.oldest_s() == 0.0 and len(graves) == 0 and drained()
