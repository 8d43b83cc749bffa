"""One node's mistake ends that node only, on real torchrun agents and a real etcd: a node whose own checkpoint
dir is unusable exits 69 (exit_codes.NODE_LOCAL) with its line, and a node started with training flags that
differ from the job's is refused with one line naming them (exit 78); in both cases the running nodes train on
past the step of the join and the job's rendezvous stays open.

    python -m pytest -q tests/e2e/test_one_node.py
"""

from __future__ import annotations

import pytest
from etcd_fixtures import rdzv_params

from e2e.job import Job
from elastic_mnist import procs
from elastic_mnist.contract import exit_codes
from elastic_mnist.etcd.rdzv_state import decode_state
from elastic_mnist.rendezvous.etcd_v3 import create_backend

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 1000  # never reached: the test ends the job once it has seen what it needs
MORE = 20  # steps the running nodes must train after the newcomer ended (2 s at --min-step-time 0.1)


def _still_open(job: Job) -> bool:
    backend, _store = create_backend(rdzv_params(job.endpoint, run_id=job.run_id))
    try:
        return not decode_state(backend.get_state()[0]).closed
    finally:
        backend.client.close()


def _newcomer_ends_alone(job: Job, newcomer: int, code: int, line: str) -> str:
    """Start node `newcomer` once the others train; it ends with `code` and `line`, the others go on."""
    running = job.agents[:]
    procs.wait_for(lambda: job.latest_step() >= 5, 240, "the running nodes to train")
    at_join = job.latest_step()
    agent = job.start_node(newcomer)
    assert agent.wait(timeout=120) == code, job.logs()
    log = (job.tmp / f"node{newcomer}-{len(running)}.log").read_text(errors="replace")
    assert line in log, log[-3000:]
    procs.wait_for(lambda: job.latest_step() >= at_join + MORE, 120, f"training past step {at_join + MORE}")
    assert [a.poll() for a in running] == [None] * len(running), job.logs()
    assert _still_open(job), "the job's rendezvous was closed"
    return log


def test_a_node_whose_checkpoint_dir_is_a_file_ends_alone(tmp_path, small_mnist, etcd_server_v3only):
    (tmp_path / "not-a-dir").write_text("a file where node 2's checkpoint directory should be\n")
    job = Job(tmp_path, small_mnist, etcd_server_v3only.endpoint, "etcd-v3", STEPS, "--epochs=100",
              "--checkpoint-storage=local", nodes=3, min_nodes=2)
    job.node_args[2] = [f"--checkpoint-dir={tmp_path / 'not-a-dir'}"]
    try:
        job.start_node(0)
        job.start_node(1)
        log = _newcomer_ends_alone(job, 2, exit_codes.NODE_LOCAL, "not-a-dir is a file, not a directory")
        assert "this node ends, the job goes on without it" in log, log[-3000:]
        assert (tmp_path / "not-a-dir").read_text().startswith("a file where"), "the file is as it was"
    finally:
        job.kill_all()


def test_a_node_with_another_lr_is_refused_and_the_job_trains_on(tmp_path, small_mnist, etcd_server_v3only):
    job = Job(tmp_path, small_mnist, etcd_server_v3only.endpoint, "etcd-v3", STEPS, "--epochs=100", nodes=2,
              min_nodes=1)
    job.node_args[1] = ["--lr=0.5"]
    try:
        job.start_node(0)
        log = _newcomer_ends_alone(job, 1, exit_codes.PERMANENT, "--lr 0.5 (the job: 0.001)")
        assert "elastic-mnist train" not in log, "no worker of the refused node started"
    finally:
        job.kill_all()
