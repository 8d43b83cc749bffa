"""The muster before a round's process group forms (elastic_mnist/distributed.py), on real TCPStores on this
machine's loopback, one thread per rank: a rank that never comes costs a kept worker the round, not itself.

    python -m pytest -q tests/test_muster.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from elastic_mnist import distributed
from elastic_mnist.distributed import GroupFormationError, StoppedBeforeForming, muster, read_env
from elastic_mnist.etcd.server import free_port


def env_of(rank: int, world: int, port: int) -> distributed.DistEnv:
    return read_env({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port)})


def in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:  # noqa: BLE001 - the test reads what the rank ended with
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def stopped_after(env: distributed.DistEnv, delay_s: float) -> tuple[object, float]:
    """A muster (60 s to form) that a stop reaches after `delay_s`: what it ended with, and when."""
    stop = threading.Event()
    started = time.monotonic()
    rank, got = in_thread(lambda: muster(env, 60, stop.is_set))
    time.sleep(delay_s)  # the fault: a stop while the muster waits (nothing here waits on it)
    stop.set()
    rank.join(10)
    return got[0], time.monotonic() - started


def test_every_rank_gets_the_rounds_store_once_all_have_come() -> None:
    port = free_port()
    rank1, got1 = in_thread(lambda: muster(env_of(1, 2, port), 20, lambda: False))
    time.sleep(0.05)  # (rank 1 first: it dials until rank 0 hosts the store)
    store0 = muster(env_of(0, 2, port), 20, lambda: False)
    rank1.join(20)
    assert not isinstance(got1[0], Exception)
    store0.set("x", b"from rank 0")
    assert got1[0].get("x") == b"from rank 0"


def test_a_stop_while_a_peer_never_comes_ends_the_muster_not_the_process() -> None:
    port = free_port()
    ended, took = stopped_after(env_of(0, 2, port), 0.3)
    assert isinstance(ended, StoppedBeforeForming) and took < 2.0
    # Nothing left behind: the next round's rank 0 in this process hosts a store on the same port.
    rank1, got1 = in_thread(lambda: muster(env_of(1, 2, port), 20, lambda: False))
    assert muster(env_of(0, 2, port), 20, lambda: False) is not None
    rank1.join(20)
    assert not isinstance(got1[0], Exception)


def test_a_stop_while_rank_0_never_listens_ends_the_dialling() -> None:
    stop = threading.Event()
    rank1, got = in_thread(lambda: muster(env_of(1, 2, free_port()), 60, stop.is_set))
    time.sleep(0.2)
    stop.set()
    rank1.join(5)
    assert isinstance(got[0], StoppedBeforeForming)


def test_peers_that_do_not_come_in_time_are_named_and_leave_the_process_clean() -> None:
    with pytest.raises(GroupFormationError, match=r"ranks \[1, 2\] of this round's 3") as caught:
        muster(env_of(0, 3, free_port()), 0.3, lambda: False)
    assert caught.value.clean


def test_without_torchrun_or_with_torchruns_agent_store_torch_makes_the_store(monkeypatch) -> None:
    assert muster(read_env({}), 1, lambda: False) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert muster(env_of(0, 2, free_port()), 1, lambda: False) is None


FROZEN_STORE = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60), multi_tenant=True)
print("up", flush=True)
time.sleep(300)
"""


@pytest.fixture(scope="module")
def frozen_rank0_store():
    """The port of a rank 0's store whose process is stopped (SIGSTOP) once it listens: the kernel still
    completes a client's handshake, and then nothing answers, as from a frozen node (one for the module:
    each test dials it afresh)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", FROZEN_STORE, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        os.kill(proc.pid, signal.SIGSTOP)
        yield port
    finally:
        proc.kill()
        proc.wait(10)


def test_a_stop_ends_the_muster_at_a_rank_0_that_froze_after_listening(frozen_rank0_store) -> None:
    ended, took = stopped_after(env_of(1, 2, frozen_rank0_store), 0.3)
    # torch's store client alone would wait there until rank 0 wakes, past its own 60 s timeout
    assert isinstance(ended, StoppedBeforeForming) and took < 2.0


def test_a_rank_0_that_froze_after_listening_costs_the_round_its_deadline_only(frozen_rank0_store) -> None:
    started = time.monotonic()
    with pytest.raises(GroupFormationError, match="rank 0's store stopped answering") as caught:
        muster(env_of(1, 2, frozen_rank0_store), 1.0, lambda: False)
    assert caught.value.clean and time.monotonic() - started < 3.0


def test_what_the_arrival_hook_raises_reaches_the_caller() -> None:
    def fault() -> None:
        raise ValueError("the fault point fired")

    with pytest.raises(ValueError, match="the fault point fired"):
        muster(env_of(0, 1, free_port()), 5, lambda: False, fault)
