"""A node lost while the others' workers are still starting (a GPU job's CUDA and NCCL set-up) costs the
survivors a restart, not the process group's --connect-timeout.

    flock /tmp/em-heavy.lock pytest -q tests/e2e/test_startup_loss.py

Real etcd, three real torchrun nodes whose workers take 6 s to start (--startup-cost); as soon as the round
of three has formed, one node is preempted (SIGTERM to its agent) or killed (SIGKILL to its whole tree).
Its workers never reach the process group, so the others' workers, on their way into it, would wait for
a rank that never comes. --connect-timeout is 90 s here, so a first step at world size 2 within 40 s of the
fault shows the survivors' agents restarted them (rendezvous/_shrink.py).
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from e2e.job import Job
from elastic_mnist import procs
from elastic_mnist.etcd.rdzv_status import read_rendezvous_status
from elastic_mnist.runlog import read_records

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STARTUP_S, CONNECT_S = 6, 90


def _starting_workers(job: Job) -> bool:
    """Every node's agent has started its worker (a process running the train module) for a round of all."""
    status = read_rendezvous_status(job.endpoint, job.run_id)
    if status.get("phase") != "complete" or len(status["participants"]) != job.nodes:
        return False
    return all(any("\0-m\0elastic_mnist.train\0" in _cmdline(pid) for pid in procs.children().get(a.pid, []))
               for a in job.agents)  # torchrun's own child running the worker module: the round's stand-in


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _first_step_at(job: Job, world_size: int, after: float = 0.0) -> float | None:
    return min((r["time"] for r in read_records(str(job.tmp / "runs" / "events"))
                if r["event"] == "startup" and r["world_size"] == world_size and r["time"] > after), default=None)


@pytest.mark.parametrize("fault", ["preempted", "killed"])
def test_a_node_lost_while_the_others_start_costs_a_restart_not_the_connect_timeout(
        tmp_path, small_mnist, etcd_server_v3only, fault):
    job = Job(tmp_path, small_mnist, etcd_server_v3only.endpoint, "etcd-v3", 40, f"--startup-cost={STARTUP_S}",
              f"--connect-timeout={CONNECT_S}", nodes=3, min_nodes=1)
    try:
        job.start()
        procs.wait_for(lambda: _starting_workers(job), 120, "the workers of a round of three starting")
        lost = job.agents[2]
        faulted = time.time()
        if fault == "preempted":
            lost.send_signal(signal.SIGTERM)
        else:
            procs.signal_tree(lost.pid, signal.SIGKILL)  # the node's whole tree, warm process included
        lost.wait(timeout=60)
        assert _first_step_at(job, 3) is None, "the fault came while the workers were still starting"
        # after the fault: a node slow to come up may have let two train for a moment before the third joined
        first = procs.wait_for(lambda: _first_step_at(job, 2, faulted), 60, "a first step at world size 2")
        assert first - faulted < 40, f"first step at world size 2 {first - faulted:.0f}s after the fault\n{job.logs()}"
        logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("node*.log"))
        assert "(1 of its 3 nodes)" in logs, job.logs()
        for agent in job.agents[:2]:
            assert agent.wait(timeout=180) == 0, job.logs()
        assert job.redone_steps() == 0
    except (TimeoutError, subprocess.TimeoutExpired):
        print(job.logs())
        raise
    finally:
        job.kill_all()
