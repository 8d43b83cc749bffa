"""The only reader of torchrun's environment: rank, world, restart count; process group setup and teardown.

    torchrun --nproc-per-node=2 -m elastic_mnist.train ...   # RANK, WORLD_SIZE, ... come from torchrun

Everything else takes rank and world size as arguments, so multi-rank logic stays testable in one process.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elastic_mnist.compat import private as compat
from elastic_mnist.contract.env import NODE_ENV, peer_beacons
from elastic_mnist.contract.errors import NodeLocalError
from elastic_mnist.contract.keys import MUSTER_PREFIX
from elastic_mnist.graveyard import RELEASE_MARGIN_S, Graveyard, begin_round, cut_round, round_number
from elastic_mnist.netprobe import wait_for_listener


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as torchrun described it (or a lone process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = "local"
    launched: bool = False
    """True under torchrun (or any launcher that sets RANK/WORLD_SIZE)."""
    node: str = ""
    """The node's name as its launcher gave it ($ELASTIC_MNIST_NODE), else the host name."""
    peer_beacons: dict[str, str] = field(default_factory=dict)
    """The round's other nodes' agent beacons (node -> host:port), from the etcd-v3 agent (netprobe.py)."""
    master: tuple[str, int] | None = None
    """Where rank 0 hosts this round's store (torchrun's MASTER_ADDR and MASTER_PORT)."""


def read_env(environ: dict | None = None) -> DistEnv:
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return DistEnv(node=env.get(NODE_ENV) or socket.gethostname())
    return DistEnv(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
        group_rank=int(env.get("GROUP_RANK", 0)),
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)),
        run_id=env.get("TORCHELASTIC_RUN_ID", "local"),
        launched=True,
        node=env.get(NODE_ENV) or socket.gethostname(),
        peer_beacons=peer_beacons(env),
        master=_master(env),
    )


def _master(env) -> tuple[str, int] | None:
    port = env.get("MASTER_PORT", "")
    return (env["MASTER_ADDR"], int(port)) if env.get("MASTER_ADDR") and port.isdigit() else None


def pick_backend(requested: str, local_world_size: int) -> str:
    if requested == "auto":
        has_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
        return "nccl" if has_gpus else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():  # this node's: another node may have its GPUs
        raise NodeLocalError("--backend nccl needs a CUDA GPU but none is visible on this node; use --backend gloo "
                             "or auto, or give this node its GPUs")
    return requested


# On an NCCL error or timeout, abort the communicators and raise in the blocked call, but keep the process
# (2 = CleanUpOnly), so it can save the last agreed step and exit for torchrun to restart it. torchrun's
# agent always passes its own value to workers (1 = TearDown unless the agent's environment says
# otherwise: local_elastic_agent.py), which kills the process first: so the worker sets it, before the
# NCCL group exists (the process group reads it at creation).
NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_ERROR_HANDLING = "2"


def set_nccl_error_handling(environ, report: bool = True) -> None:
    """Put NCCL's error handling in the mode the failure path needs, whatever the launcher passed; say so
    once (report) when it replaced another value."""
    given = environ.get(NCCL_ERROR_HANDLING_ENV)
    environ[NCCL_ERROR_HANDLING_ENV] = NCCL_ERROR_HANDLING
    if report and given not in (None, NCCL_ERROR_HANDLING):
        print(f"elastic-mnist train: {NCCL_ERROR_HANDLING_ENV}={given} (from the launcher) replaced by "
              f"{NCCL_ERROR_HANDLING} (CleanUpOnly): a lost peer must raise in this process, which then saves "
              "the last agreed step, rather than end it", file=sys.stderr, flush=True)


class GroupFormationError(RuntimeError):
    """The workers of this round did not all connect within the formation bound."""

    def __init__(self, message: str, clean: bool = False) -> None:
        super().__init__(message)
        self.clean = clean
        """Nothing of torch's process group was made (the muster failed): the process is as it was."""


class StoppedBeforeForming(Exception):
    """A stop came while this round's workers mustered: nothing of the round was made."""


MUSTER_POLL_S = 0.005
MUSTER_REPORT_S = 0.5  # at the deadline: how long the store may take to name the ranks that did not come


def muster(env: DistEnv, connect_s: float, stopped: Callable[[], bool], arrived: Callable[[], None] = lambda: None):
    """The round's store, once every rank has said it is there: the waiting a lost peer causes happens here,
    in Python, where a stop is seen within a few ms and leaves nothing behind, instead of inside the C++ that
    forms the group (which no stop can interrupt: a kept worker asked to stop there could only exit). None
    where torch's own rendezvous makes the store (no torchrun, or torchrun's agent hosts it: c10d). `arrived`:
    called once the store is up (tests' fault points)."""
    if not env.launched or env.master is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        return None
    begin_round()  # what connects from here on is this round's (abandon_round cuts it)
    host, port = env.master
    deadline = time.monotonic() + connect_s
    try:
        # torch's store client, refused, dials again only after 0.3-0.7 s (its backoff's first step): a
        # member that attaches a few ms before rank 0 hosts the store would cost the whole round that.
        if env.rank != 0 and not wait_for_listener(host, port, connect_s, stopped=stopped) and not stopped():
            raise GroupFormationError(f"rank 0's store at {host}:{port} did not answer within {connect_s:.0f}s "
                                      "(--connect-timeout)", clean=True)
        if stopped():
            raise StoppedBeforeForming()
        caller = _StoreCalls(env, connect_s, arrived)
        caller.start()
        while not caller.done.wait(MUSTER_POLL_S):
            if stopped() or time.monotonic() > deadline:
                raise caller.give_up(stopped(), connect_s)
        if caller.error is not None:
            raise caller.error
        return caller.store
    except GroupFormationError:
        raise
    except RuntimeError as e:  # the store's own errors (a rank 0 that died, a refused client)
        raise GroupFormationError(f"this round's store at {host}:{port} failed before the group formed: "
                                  f"{str(e).splitlines()[0][:200]}", clean=True) from e


class _StoreCalls(threading.Thread):
    """A muster's store calls, on a thread of their own. torch's store client, connected to a rank 0 that
    then froze (its process stopped, its host dark after the handshake), blocks in its constructor past its
    timeout and in `check` past `set_timeout`: only a thread leaves the muster free to see a stop or its
    deadline. Given up, the thread ends when the call it is in does (the peer resumes or its socket closes)
    and drops the store; it hands nothing back."""

    def __init__(self, env: DistEnv, connect_s: float, arrived: Callable[[], None]) -> None:
        super().__init__(daemon=True, name="muster")
        self.env, self.connect_s, self.arrived = env, connect_s, arrived
        self.keys = [f"{MUSTER_PREFIX}{r}" for r in range(env.world_size)]
        self.done, self.given_up = threading.Event(), threading.Event()
        self.store, self.error, self.missing = None, None, None

    def run(self) -> None:
        host, port = self.env.master
        try:
            store = dist.TCPStore(host, port, self.env.world_size, is_master=self.env.rank == 0,
                                  wait_for_workers=False, timeout=datetime.timedelta(seconds=self.connect_s),
                                  multi_tenant=True)
            if not self.given_up.is_set():
                self.arrived()
                store.set(self.keys[self.env.rank], b"1")
            while not self.given_up.is_set():
                if store.check(self.keys):
                    self.store = store
                    return
                time.sleep(MUSTER_POLL_S)
            self.missing = [r for r, key in enumerate(self.keys) if not store.check([key])]
        except Exception as e:  # noqa: BLE001 - raised in the muster's own thread (the store's, or `arrived`'s)
            self.error = e
        finally:
            self.done.set()

    def give_up(self, stopped: bool, connect_s: float) -> Exception:
        """The muster's error, once this thread is told to let go. Rank 0 hosts the store in this process,
        so its calls never wait on a peer: it is waited for, and the next round may host on the same port."""
        self.given_up.set()
        if self.env.rank == 0 or not stopped:
            self.done.wait(1.0 if self.env.rank == 0 else MUSTER_REPORT_S)
        if stopped:
            return StoppedBeforeForming()
        if self.missing is None:
            return GroupFormationError(f"rank 0's store stopped answering this round's muster within "
                                       f"{connect_s:.0f}s (--connect-timeout)", clean=True)
        return GroupFormationError(f"ranks {self.missing} of this round's {self.env.world_size} did not come "
                                   f"within {connect_s:.0f}s (--connect-timeout)", clean=True)


def read_local(environ: dict | None = None) -> tuple[int, int]:
    """(local rank, local world size): what a worker started before its round knows of its place."""
    env = os.environ if environ is None else environ
    return int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))


def pick_device(requested_backend: str, local_rank: int, local_world_size: int) -> torch.device:
    """This process's device (set as CUDA's current one): once per process, before any round."""
    if pick_backend(requested_backend, local_world_size) != "nccl":
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise NodeLocalError(f"local rank {local_rank} has no CUDA GPU on this node ({torch.cuda.device_count()} "
                             "visible): start this node with at most one worker per GPU (--nproc-per-node)")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def init(env: DistEnv, requested_backend: str, timeout_s: float, connect_s: float | None = None,
         store=None) -> torch.device:
    """Join the process group (a lone process gets a one-member group) and pick this rank's device.
    Forming the group may take `connect_s` (default: `timeout_s`), every collective after it `timeout_s`:
    a peer this host cannot reach (a partial partition) costs the round the short bound, not a collective's.
    `store`: the round's, from `muster` (else torch's rendezvous makes it from the environment)."""
    backend = pick_backend(requested_backend, env.local_world_size)
    device = pick_device(requested_backend, env.local_rank, env.local_world_size)
    if backend == "nccl":
        set_nccl_error_handling(os.environ, env.local_rank == 0)
    _ABANDONED.clear()  # a new round: its collectives wait again
    _GLOO[0] = backend == "gloo"
    _GRAVEYARD.hold_s = max(timeout_s, connect_s or 0.0) + RELEASE_MARGIN_S
    _GRAVEYARD.round += 1
    timeout = datetime.timedelta(seconds=connect_s or timeout_s)
    if env.launched:
        kwargs = {"device_id": device} if backend == "nccl" else {}
        if store is not None:
            kwargs.update(store=store, rank=env.rank, world_size=env.world_size)
        elif env.rank != 0 and env.master is not None:  # (see muster)
            wait_for_listener(*env.master, timeout.total_seconds())
        try:
            dist.init_process_group(backend, timeout=timeout, **kwargs)
        except RuntimeError as e:  # the store's wait for the others, or gloo's connect to each of them
            raise GroupFormationError(f"the {env.world_size} workers of this round did not connect to each other "
                                      f"within {timeout.total_seconds():.0f}s (--connect-timeout): "
                                      f"{str(e).splitlines()[0][:200]}") from e
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    if connect_s and connect_s != timeout_s:
        compat.set_group_timeout(timeout_s)
    return device


def group_device() -> torch.device:
    """Where tensors for the default (data) group must live: this rank's GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def abort_data_group() -> None:
    """Abort the NCCL communicators so a collective blocked on a lost peer returns at once (safe from
    another thread; torch documents it for NCCL)."""
    try:
        compat.abort_process_group()
    except (RuntimeError, ValueError):  # already aborted, destroyed, or a backend without abort
        pass


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# -- rounds in place: a collective that a lost peer cannot hold, and a teardown that never waits on one -------
class RoundAbandoned(RuntimeError):
    """This round was given up (a peer is lost) while this thread waited in one of its collectives."""


_ABANDONED = threading.Event()
_GLOO = [False]  # this round's data group is gloo's (set as it forms: the watch thread asks no torch)
_WAITERS: set[threading.Event] = set()
_WAITERS_LOCK = threading.Lock()
MAX_ABANDONED_GROUPS = 32  # each holds sockets until its timeouts: past this many, start afresh instead
_GRAVEYARD = Graveyard()


def wait(work, gloo: bool | None = None) -> None:
    """Wait for a collective started with async_op=True (on the default group, or a `gloo` one). On CPU
    `abandon_round` ends the wait with RoundAbandoned: gloo's own wait would last until the collective's
    timeout on a vanished or frozen peer. NCCL only queues it on the stream (its abort ends what waits)."""
    if _ABANDONED.is_set():
        if not work.is_completed():
            _GRAVEYARD.bury(work)
        raise RoundAbandoned("the round was given up")
    if not (gloo or (gloo is None and dist.get_backend() != "nccl")):
        work.wait()
        return
    done = threading.Event()
    with _WAITERS_LOCK:
        _WAITERS.add(done)
    try:
        work.get_future().add_done_callback(lambda _future: done.set())
        done.wait()
    finally:
        with _WAITERS_LOCK:
            _WAITERS.discard(done)
    if _ABANDONED.is_set() and not work.is_completed():
        _GRAVEYARD.bury(work)  # its buffers stay valid for gloo's threads until it times out
        raise RoundAbandoned("the round was given up while a collective waited on a lost peer")
    work.wait()  # done: returns at once, or raises the collective's own error


def this_round() -> tuple[int, int]:
    """The round now under way, as `abandon_round` takes it: its group's number and its connections'."""
    return _GRAVEYARD.round, round_number()


def abandon_round(which: tuple[int, int] | None = None) -> None:
    """From any thread: every collective this process waits in (and any it starts) raises RoundAbandoned;
    on gloo, one that torch waits on by itself fails too, its connections cut (graveyard.cut_round).
    `which` (this_round()): nothing happens once a later round began (a watch thread of a round already over)."""
    if which is not None and which[0] != _GRAVEYARD.round:
        return
    _ABANDONED.set()
    with _WAITERS_LOCK:
        for done in _WAITERS:
            done.set()
    if _GLOO[0]:
        cut_round(round_number() if which is None else which[1])


def teardown(abandoned: bool) -> str:
    """End this round's process group. After a clean round end it is destroyed; after a lost peer
    (`abandoned`) it is not waited on: NCCL's is aborted, gloo's destroyed but kept referenced (its threads
    may wait on the dead peer until the timeout, and the last reference would join them). "" when done, else
    why this process should start afresh instead."""
    if not dist.is_initialized():
        return ""
    if abandoned:
        _GRAVEYARD.bury(dist.group.WORLD)
    try:
        if abandoned and dist.get_backend() == "nccl":
            compat.abort_process_group()
        dist.destroy_process_group()
    except (RuntimeError, ValueError) as e:
        return f"tearing down the process group failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    _GRAVEYARD.reap()  # this round's too, when nothing of it is in flight
    if _GRAVEYARD.groups() > MAX_ABANDONED_GROUPS:
        return f"{_GRAVEYARD.groups()} process groups given up in this process still wait on lost peers"
    return ""


def bury(group) -> None:
    """Keep a group given up with a lost peer (the control plane's) referenced past its round (see teardown)."""
    _GRAVEYARD.bury(group)


def held_groups() -> dict:
    """What this process still holds of rounds given up (journaled at each round's end)."""
    return {"given_up": _GRAVEYARD.groups(), "given_up_in_flight": len(_GRAVEYARD) - _GRAVEYARD.groups(),
            "given_up_oldest_s": _GRAVEYARD.oldest_s()}
