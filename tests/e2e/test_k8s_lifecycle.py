"""The trainer pod of the rendered Job, run without a cluster: its init containers and its container, with
command, arguments and environment taken from the manifest, as local processes against a real etcd.

    python -m pytest -q -m e2e tests/e2e/test_k8s_lifecycle.py

What the kubelet would fill in is substituted: the downward API (job name label, the Job's UID, the pod
IP 127.0.0.1, JOB_COMPLETION_INDEX), the volumes (/data/mnist -> small generated MNIST, the rest of
/data and /tmp -> temp dirs, the etcd Secret -> a directory with the job user's password and a
generated rendezvous secret), the etcd address, --backend=gloo (no GPU) and a small --max-steps.
etcd runs with authentication for the default backend, as in the cluster; torch's legacy `etcd`
backend has no credentials, so there etcd runs without and the user/password variables are dropped.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from etcd_fixtures import write_test_pki
from k8s_manifests import container, find, pod_spec

from e2e.k8s_local import Cluster, LocalPod, etcd_for, render, run_together
from elastic_mnist import procs
from elastic_mnist.etcd.rdzv_status import read_rendezvous_status
from elastic_mnist.etcd.server import EtcdServer, free_port
from elastic_mnist.ops.preflight import NODE_LOCAL, PERMANENT
from elastic_mnist.state.format import list_checkpoints

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
# "At once": far below the join_timeout=600 a pod that waited would take, above two cold torch imports
# (preflight and the pod entry) on a loaded 2-core CI machine (10.0 s seen there)
AT_ONCE_S = 30


def exits_0_at_once_saying(pod: LocalPod, marker: str) -> None:
    """A pod that has nothing to do: exit 0 within AT_ONCE_S, each container's log one line saying why."""
    start = time.monotonic()
    assert pod.run(timeout=60) == (0, "trainer"), pod.log()
    assert time.monotonic() - start < AT_ONCE_S, pod.log()
    for name in ("preflight", "trainer"):
        lines = pod.container_log(name)
        assert [marker in line for line in lines].count(True) == 1, pod.log()
    assert pod.container_log("trainer") == [line for line in pod.container_log("trainer") if marker in line], pod.log()


@pytest.mark.parametrize("variant", [render.DEFAULT_OVERLAY, "legacy-etcd"], ids=["k8s-default", "legacy-etcd"])
def test_a_two_pods_train_to_the_end_and_a_late_pod_exits_0_at_once(variant, small_mnist, tmp_path):
    with etcd_for(variant) as server:
        cluster = Cluster(variant, tmp_path, server, small_mnist, steps=20)
        try:
            results = run_together([cluster.pod(0), cluster.pod(1)])
            assert results == [(0, "trainer"), (0, "trainer")], cluster.logs()
            summary = cluster.summary()
            assert summary["world_size"] == 2 and summary["global_step"] == 20, summary
            assert json.loads((cluster.job_dir("checkpoints") / "finished.json").read_text())["step"] == 20

            # A replacement pod, or a resize that came too late.
            exits_0_at_once_saying(cluster.pod(2), "job already finished at step 20")
            if variant == render.DEFAULT_OVERLAY:
                # A late plain torchrun (no pod entry): the backend sees the closed rendezvous and the
                # agents' exit barrier of its last round, and ends torchrun before its agent starts.
                start = time.monotonic()
                late = cluster.pod(5).plain_torchrun()
                assert time.monotonic() - start < AT_ONCE_S, late.stderr
                assert late.returncode == 0, late.stdout + late.stderr
                lines = (late.stdout + late.stderr).splitlines()
                assert len(lines) == 1 and "is closed: the job finished" in lines[0], lines
            # Without the marker the closed rendezvous means a node gave up: fail the Job at once
            # (no crash loop), saying how to resume.
            (cluster.job_dir("checkpoints") / "finished.json").unlink()
            given_up = cluster.pod(3)
            start = time.monotonic()
            assert given_up.run(timeout=60) == (PERMANENT, "preflight"), given_up.log()
            assert time.monotonic() - start < AT_ONCE_S, given_up.log()
            (line,) = [log_line for log_line in given_up.container_log("preflight") if "FAILED" in log_line]
            assert "is closed but the job did not finish" in line and "re-apply the Job" in line
            # The same from the trainer container alone (docker compose, a pod without the init step).
            direct = cluster.pod(0)
            assert direct.start_trainer().wait(60) == PERMANENT, direct.log()
            assert len([line for line in direct.container_log("trainer") if "is closed" in line]) == 1, direct.log()
        finally:
            cluster.close()


def test_b_missing_mnist_fails_the_job_before_torchrun_and_burns_nothing(small_mnist, tmp_path):
    with etcd_for(render.DEFAULT_OVERLAY) as server:
        missing = tmp_path / "mnist-later"
        cluster = Cluster(render.DEFAULT_OVERLAY, tmp_path, server, str(missing), steps=10)
        try:
            first = cluster.pod(0)
            assert first.run(timeout=60) == (PERMANENT, "preflight"), first.log()
            failed = [line for line in first.log().splitlines() if "FAILED" in line]
            assert len(failed) == 1 and "MNIST file" in failed[0] and "missing" in failed[0], first.log()
            assert "torch.distributed.run" not in first.log()
            # The rendezvous was never touched, so the same Job (the same rendezvous id) can still run.
            state = read_rendezvous_status(server.endpoint, cluster.uid, "etcd-v3", read_timeout=5.0,
                                           user="elastic-mnist",
                                           password_file=str(server.credential_file("job-password")))
            assert not state["found"], state
            shutil.copytree(small_mnist, missing)
            second = cluster.pod(1)
            assert second.run(timeout=300) == (0, "trainer"), cluster.logs()
            assert cluster.summary()["global_step"] == 10
        finally:
            cluster.close()


def test_c_sigterm_during_start_up_ends_the_pod_within_its_grace_period(small_mnist, tmp_path):
    with etcd_for(render.DEFAULT_OVERLAY) as server:
        cluster = Cluster(render.DEFAULT_OVERLAY, tmp_path, server, small_mnist, steps=100000, pace=0.05)
        grace = pod_spec(cluster.job)["terminationGracePeriodSeconds"]
        try:
            # The init container waiting for an etcd that is not up yet.
            waiting = cluster.pod(0, endpoint=f"127.0.0.1:{free_port()}")
            proc = waiting.start_init()
            procs.wait_for(lambda: "etcd: waiting" in waiting.log(), 60, "preflight to wait for etcd")
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(grace) == 128 + signal.SIGTERM
            assert time.monotonic() - start < 5, waiting.log()

            # The trainer container while torchrun is still starting.
            starting = cluster.pod(1)
            proc = starting.start_trainer()
            procs.wait_for(lambda: procs.children().get(proc.pid), 60, "torchrun to be started")
            tree = procs.descendants(proc.pid)
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(grace) == 128 + signal.SIGTERM, starting.log()
            assert time.monotonic() - start < grace / 2, starting.log()
            procs.wait_for(lambda: not any(procs.alive(p) for p in tree), 10, "the pod's processes to exit")
        finally:
            cluster.close()


@pytest.mark.parametrize("variant", [render.DEFAULT_OVERLAY, "legacy-etcd"], ids=["k8s-default", "legacy-etcd"])
def test_d_etcd_restart_mid_run(variant, small_mnist, tmp_path):
    """Default backend: training rides the restart out. torch's legacy backend: every agent exits (its
    monitor loop has no retry); the Job's replacement pods resume from the newest checkpoint."""
    with etcd_for(variant) as server:
        cluster = Cluster(variant, tmp_path, server, small_mnist, steps=200, pace=0.05)
        try:
            pods = [cluster.pod(0), cluster.pod(1)]
            assert [p.start_init().wait(120) for p in pods] == [0, 0], cluster.logs()
            for p in pods:
                p.start_trainer()
            ckpts = cluster.job_dir("checkpoints")
            procs.wait_for(lambda: any(s >= 40 for s, _ in list_checkpoints(str(ckpts))), 300, "step 40")
            server.stop()
            time.sleep(3)  # the outage under test: etcd down for 3 s (a drain or an upgrade), then back
            at_restart = list_checkpoints(str(ckpts))[0][0]
            server.restart()
            codes = [p.proc.wait(300) for p in pods]
            assert at_restart < 200, "etcd must come back while the job is still training"
            if variant == render.DEFAULT_OVERLAY:
                assert codes == [0, 0], cluster.logs()
                summary = cluster.summary()
                # Ridden out, not recovered from: no worker was restarted into a new rendezvous round.
                assert summary["restarts"] == 0 and summary["torchrun_restart_count"] == 0, summary
            else:
                assert 0 not in codes and "EtcdConnectionFailed" in cluster.logs(), cluster.logs()
                replacements = run_together([cluster.pod(2), cluster.pod(3)])
                assert replacements == [(0, "trainer"), (0, "trainer")], cluster.logs()
                summary = cluster.summary()
                assert summary["restarts"] >= 1, summary
            assert summary["global_step"] == 200 and summary["world_size"] == 2, summary
        finally:
            cluster.close()


def test_e_tls_variant_trains_to_the_end_over_https(small_mnist, tmp_path):
    """The etcd-tls rendering against an etcd that serves https with generated certificates: the etcd-auth
    sidecar's argv (CA only) applies authentication over TLS, a pod's preflight and trainer verify the
    server against the mounted ca.crt and train to the end, and the plain-http endpoint is refused."""
    pki = write_test_pki(tmp_path / "pki")
    (tmp_path / "tls").mkdir()
    shutil.copy(pki["ca"], tmp_path / "tls" / "ca.crt")  # the Secret elastic-mnist-etcd-tls, CA item only
    with EtcdServer(enable_v2=False, auth=True, tls={"cert_file": pki["cert"], "key_file": pki["key"],
                                                     "ca_file": pki["ca"]}) as server:
        cluster = Cluster("etcd-tls", tmp_path, server, small_mnist, steps=10)
        try:
            etcd = find(cluster.docs, "StatefulSet", "etcd")
            sidecar = container(etcd, "etcd-auth")
            args = [a for a in sidecar["args"] if not a.startswith(("--recheck", "--ready-file", "--endpoint"))]
            args = [a.replace("/etc/elastic-mnist/etcd-tls", str(tmp_path / "tls")) for a in args]
            secret = tmp_path / "secret"
            shutil.copy(server.credential_file("root-password"), secret / "root-password")
            args = [a.replace("/etc/elastic-mnist/etcd", str(secret)) for a in args]
            auth = subprocess.run([shutil.which("elastic-mnist", path=str(Path(sys.executable).parent)),
                                   "etcd-auth", f"--endpoint={server.endpoint}", *args], capture_output=True,
                                  text=True, timeout=120, env=procs.child_env())
            assert auth.returncode == 0, auth.stdout + auth.stderr
            pod = cluster.pod(0)
            assert pod.run(timeout=300) == (0, "trainer"), cluster.logs()
            assert cluster.summary()["global_step"] == 10
            assert "protocol=https" in pod.log()
        finally:
            cluster.close()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a node without a GPU")
def test_f_nccl_preflight_in_a_gpu_less_container_fails_only_its_index(small_mnist, tmp_path):
    """A GPU variant's pod as it is (--backend=nccl) on this GPU-less machine: the preflight container exits
    with the node-local code, one FAILED line, and the Job's rule for it is FailIndex, not FailJob."""
    with etcd_for("kind-gpu") as server:
        cluster = Cluster("kind-gpu", tmp_path, server, small_mnist, steps=10)
        try:
            pod = cluster.pod(0)
            pod.backend = None
            assert pod.run(timeout=120) == (NODE_LOCAL, "preflight"), pod.log()
            assert NODE_LOCAL != PERMANENT and "--backend=nccl" in pod.log()
            (line,) = [x for x in pod.container_log("preflight") if "FAILED" in x]
            assert line.startswith("preflight: device: FAILED") and "no CUDA device" in line, line
            rules = [r for r in cluster.job["spec"]["podFailurePolicy"]["rules"]
                     if r.get("onExitCodes", {}).get("containerName") == "preflight"
                     and NODE_LOCAL in r["onExitCodes"]["values"]]
            assert [r["action"] for r in rules] == ["FailIndex"]
        finally:
            cluster.close()
