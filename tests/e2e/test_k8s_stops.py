"""A stop exits as a stop: the rendered trainer container (`elastic-mnist pod` over real torchrun, against a
real etcd) signalled with SIGTERM in each phase of its life exits 143, which the Job ignores, and 0 once the
job finished; no process of the container outlives it, and a stop saves the step it reached.

    python -m pytest -q -m e2e tests/e2e/test_k8s_stops.py

(torchrun alone exits 1 on SIGTERM: it raises SignalException out of its launcher, which the Job would count
as a failure. The phases: the pod entry's own checks, torchrun's rendezvous, training, a save in flight.)
"""

from __future__ import annotations

import copy
import os
import re
import signal
import socket
import time

import pytest
from k8s_manifests import container, pod_spec

from e2e.k8s_local import Cluster, LocalPod, etcd_for, render
from elastic_mnist import procs
from elastic_mnist.contract import exit_codes
from elastic_mnist.etcd.rdzv_status import read_rendezvous_status
from elastic_mnist.state.format import list_checkpoints

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STOPPED = exit_codes.killed_by(signal.SIGTERM)
TEMP = re.compile(r"^\.ckpt-(\d+)\.pt\.tmp-")


def stop(pod: LocalPod, grace: float) -> tuple[int, list[int]]:
    """SIGTERM to the container's PID 1, as the kubelet sends it: (its exit code, its processes that were
    still alive when it exited)."""
    tree = procs.descendants(pod.proc.pid)
    pod.proc.send_signal(signal.SIGTERM)
    code = pod.proc.wait(grace)
    return code, [p for p in tree if p != pod.proc.pid and procs.alive(p)]


def test_a_sigterm_in_every_phase_exits_143_and_at_the_end_0(small_mnist, tmp_path):
    with etcd_for(render.DEFAULT_OVERLAY) as server:
        clusters = []

        def cluster(name: str, **kw) -> Cluster:
            clusters.append(Cluster(render.DEFAULT_OVERLAY, tmp_path / name, server, small_mnist, **kw))
            return clusters[-1]

        try:
            checks(cluster("checks", steps=100000))
            rendezvous(cluster("rendezvous", steps=100000), server)
            training(cluster("training", steps=100000, pace=0.05))
            saving(cluster("saving", steps=100000, pace=0.05))
            finished(cluster("finished", steps=40, pace=0.05))
        finally:
            for c in clusters:
                c.close()


def checks(cluster: Cluster) -> None:
    """Before torchrun: the pod entry reads the rendezvous state from an etcd that accepts and never answers.
    Nothing is running that could save: it ends at once, not after its read timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(120)
    try:
        pod = cluster.pod(0, endpoint=f"127.0.0.1:{listener.getsockname()[1]}")
        pod.start_trainer()
        conn, _ = listener.accept()  # the pod entry's status read: it is in its checks now
        start = time.monotonic()
        assert stop(pod, 30) == (STOPPED, []), pod.log()
        assert time.monotonic() - start < 2.5, "sooner than the 3 s read timeout"
        assert "before torchrun started" in pod.log() and "torch.distributed.run" not in pod.log()
        conn.close()
    finally:
        listener.close()


def rendezvous(cluster: Cluster, server) -> None:
    """torchrun waiting in the rendezvous for a second node (--nnodes=2:4, one pod)."""
    pod = cluster.pod(0)
    pod.job = copy.deepcopy(pod.job)
    args = container(pod.job, "trainer")["args"]
    args[args.index("--nnodes=1:4")] = "--nnodes=2:4"

    def joined() -> bool:
        state = read_rendezvous_status(server.endpoint, cluster.uid, "etcd-v3", read_timeout=5.0,
                                       user="elastic-mnist", password_file=str(server.credential_file("job-password")))
        return state["found"] and bool(state.get("participants"))

    pod.start_trainer()
    procs.wait_for(joined, 120, "the pod's node to wait in the rendezvous", interval_s=0.2)
    assert stop(pod, pod_spec(cluster.job)["terminationGracePeriodSeconds"]) == (STOPPED, []), pod.log()
    assert not list_checkpoints(str(cluster.job_dir("checkpoints"))), "nothing trained, nothing saved"


def training(cluster: Cluster) -> None:
    """Training: the workers stop at the next step and save it; torchrun exits 1 (SignalException)."""
    pod, ckpts = cluster.pod(0), cluster.job_dir("checkpoints")
    pod.start_trainer()
    at_signal = procs.wait_for(lambda: list_checkpoints(str(ckpts)), 180, "a checkpoint")[0][0]
    assert stop(pod, pod_spec(cluster.job)["terminationGracePeriodSeconds"]) == (STOPPED, []), pod.log()
    assert list_checkpoints(str(ckpts))[0][0] > at_signal, "the stop saved the step it reached"
    assert "got signal: 15" in pod.log(), "torchrun's own end: SignalException"


def saving(cluster: Cluster) -> None:
    """A checkpoint being written (its temp file is there) when the signal comes: it is published."""
    pod, ckpts = cluster.pod(0), cluster.job_dir("checkpoints")
    pod.flags = [*pod.flags, "--checkpoint-every=1"]
    pod.start_trainer()

    def writing() -> int | None:
        names = os.listdir(ckpts) if ckpts.is_dir() else []
        return next((int(m.group(1)) for n in names if (m := TEMP.match(n))), None)

    step = procs.wait_for(writing, 180, "a checkpoint being written", interval_s=0.002)
    assert stop(pod, pod_spec(cluster.job)["terminationGracePeriodSeconds"]) == (STOPPED, []), pod.log()
    assert step in {s for s, _ in list_checkpoints(str(ckpts))}, "the save in flight was published"
    assert writing() is None, "no temp file left behind"


def finished(cluster: Cluster) -> None:
    """A SIGTERM after the job finished (the Job controller removing the pods of a Complete Job): 0."""
    pod, done = cluster.pod(0), cluster.job_dir("checkpoints") / "finished.json"
    pod.start_trainer()
    procs.wait_for(done.exists, 240, "the job to finish", interval_s=0.01)
    assert stop(pod, pod_spec(cluster.job)["terminationGracePeriodSeconds"])[0] == exit_codes.OK, pod.log()
