"""A peer that freezes is seen by the control plane within --peer-timeout, not the collective timeout,
whether its peers wait in the data collective (gradient all-reduce) or in the per-step agreement.

Real etcd, two real torchrun nodes on gloo; the peer stops itself (SIGSTOP) at an exact step and place
(ELASTIC_MNIST_FAULT), so the survivor is blocked where a gloo send would otherwise wait for its full
60 s timeout. The survivor's peer watch ends its wait there, and the survivor keeps the last completed step in
memory for the next round (in-place rounds: no save, no exit); the test then kills the frozen worker, its
agent starts a new one, and the job finishes. Both nodes
are required (min nodes 2), so the pair has formed before the fault step: a node that trained alone past
it would leave rank 1 nothing to fire at.

    flock /tmp/em-heavy.lock pytest -q tests/e2e/test_peer_loss.py
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from e2e.job import Job
from elastic_mnist import procs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_STEPS = 60
FAULT_STEP = 20
PEER_TIMEOUT = 3.0


def _frozen_worker(job: Job) -> int:
    return next((pid for pid in job.workers() if procs.proc_state(pid) == "T"), 0)


@pytest.mark.parametrize("at", ["data", "control"])
def test_frozen_peer_is_seen_in_seconds_and_nothing_is_lost(tmp_path, small_mnist, etcd_server_v3only, at):
    job = Job(tmp_path, small_mnist, etcd_server_v3only.endpoint, "etcd-v3", MAX_STEPS, "--global-batch-size=64",
              f"--peer-timeout={PEER_TIMEOUT}",
              env={"ELASTIC_MNIST_FAULT": f"stop:rank=1:step={FAULT_STEP}:at={at}"})
    try:
        job.start()
        frozen = procs.wait_for(lambda: _frozen_worker(job), 240, "rank 1 to freeze")
        frozen_at = time.time()  # polled every 50 ms: at most that late
        lost = procs.wait_for(lambda: job.events("peer_lost"), 60, "the survivor to see the lost peer")
        assert lost[0]["time"] - frozen_at < PEER_TIMEOUT + 3, "seen within the peer timeout, not 60 s"
        kept = procs.wait_for(lambda: job.events("collective_failed"), 60, "the survivor to end its round")
        expected = FAULT_STEP + (1 if at == "control" else 0)  # steps completed everywhere before the freeze
        assert kept[0]["step"] == expected and kept[0]["in_place"], job.logs()
        assert lost[0]["pid"] == kept[0]["pid"] and not job.events("saved_by_watch"), "no save, no new process"
        os.kill(frozen, signal.SIGKILL)  # the frozen machine is lost for good
        job.finish()
        assert job.redone_steps() <= 1
    finally:
        job.kill_all()
