"""A round whose rank 0 is lost as it forms costs the other agents one round, not the store's timeout.

    python -m pytest -q tests/test_rendezvous_shrink.py

Real etcd and two agents' real rendezvous handlers (torch's dynamic handler over the etcd-v3 backend):
B, a process of its own, is killed (SIGKILL) at the moment it would write the round's master address, so
the round is complete and the address never comes; A, this process, must go on to a round of its own.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from etcd_fixtures import etcd_server_v3only, rdzv_params, wait_for_state  # noqa: F401  (a fixture)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elastic_mnist.etcd.server import EtcdServer
from elastic_mnist.rendezvous._shrink import ADDRESS_WAIT_MIN

REPO = Path(__file__).resolve().parents[1]
FAST = {"keep_alive_interval": 1, "keep_alive_max_attempt": 2, "last_call_timeout": 1, "join_timeout": 120}

# Rank 0 of a round is its first participant in torch's order, the node address first: B (127.0.0.1)
# comes before A (127.0.0.2), so B is the one that writes the address.
AGENT_DYING_AS_RANK_0 = """
import os, signal, sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from elastic_mnist.rendezvous.store import EtcdV3Store
original = EtcdV3Store.set
def set_or_die(self, key, value):
    if key.endswith("MASTER_ADDR"):  # the round is complete; its address is never written
        print("dying", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    original(self, key, value)
EtcdV3Store.set = set_or_die
params = RendezvousParameters("etcd-v3", sys.argv[1], sys.argv[2], 2, 2, local_addr="127.0.0.1",
                              keep_alive_interval=1, keep_alive_max_attempt=2, join_timeout=120, warm_start=0)
get_rendezvous_handler(params).next_rendezvous()
"""


@pytest.mark.slow
def test_a_rank_0_lost_before_it_writes_its_address_costs_a_round_not_the_store_timeout(
        etcd_server_v3only: EtcdServer, capfd: pytest.CaptureFixture) -> None:  # noqa: F811
    server, run_id = etcd_server_v3only, "rank0-lost"
    b = subprocess.Popen([sys.executable, "-c", AGENT_DYING_AS_RANK_0, server.endpoint, run_id],
                         stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        wait_for_state(server, run_id, lambda state: len(state.participants) == 1)
        a = get_rendezvous_handler(rdzv_params(server.endpoint, run_id, 1, 2, local_addr="127.0.0.2", **FAST))
        started = time.monotonic()
        info = a.next_rendezvous()  # joins B's round (2 of 2: complete at once), then waits for its address
        elapsed = time.monotonic() - started
        assert b.wait(timeout=10) == -signal.SIGKILL and b.stdout.read() == "dying\n", "B died as rank 0"
        assert (info.rank, info.world_size) == (0, 1), "A formed a round of its own"
        wait = ADDRESS_WAIT_MIN.total_seconds()  # twice the 2 s heartbeat window is less
        assert wait <= elapsed < wait + 15, f"{elapsed:.1f}s: the address wait and one round, not 300 s"
        assert f"did not write its address within {wait:.0f}s" in capfd.readouterr().err
        a.shutdown()
    finally:
        b.kill()
        b.wait()
