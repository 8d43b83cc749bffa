"""`elastic-mnist status` against a live job started by `elastic-mnist local`, text and JSON."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from conftest import REPO, worker_env

from elastic_mnist.runlog import read_records

pytestmark = pytest.mark.e2e


def _status(run_dir, *extra: str) -> subprocess.CompletedProcess:
    etcd = json.loads((run_dir / "etcd.json").read_text())
    cmd = [sys.executable, "-m", "elastic_mnist", "status", "--rdzv-endpoint", etcd["endpoint"],
           "--rdzv-id", etcd["rdzv_id"], "--rdzv-backend", etcd["rdzv_backend"],
           "--checkpoint-dir", str(run_dir / "checkpoints"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=worker_env(), cwd=REPO)


@pytest.mark.parametrize("backend", ["etcd-v3", "etcd"])
def test_status_of_a_live_job(small_mnist, tmp_path, backend):
    cmd = [sys.executable, "-m", "elastic_mnist", "local", "--nodes", "2", "--rdzv-backend", backend,
           "--run-dir", str(tmp_path), "--data-dir", small_mnist, "--max-steps", "100000", "--epochs", "1000",
           "--min-step-time", "0.05", "--checkpoint-every", "5"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=worker_env(), cwd=REPO)
    try:
        seen = 0
        for line in launcher.stdout:  # past the first checkpoint: a real event, not a sleep
            seen += "[train]" in line
            if seen >= 1:
                break
        as_json = _status(tmp_path, "--json")
        assert as_json.returncode == 0, as_json.stderr
        status = json.loads(as_json.stdout)
        assert status["found"] and status["phase"] == "complete" and isinstance(status["round"], int)
        assert sorted(p["rank"] for p in status["participants"]) == [0, 1]
        assert status["checkpoint"]["step"] >= 5 and status["checkpoint"]["world_size"] == 2
        text = _status(tmp_path)
        assert text.returncode == 0, text.stderr
        assert "2 participant(s)" in text.stdout and "latest checkpoint: step" in text.stdout
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=90)  # drains the pipe while the launcher stops everything
    # every node was asked to stop at once: none saw the others leave and trained on in a smaller round
    assert {r["world_size"] for r in read_records(str(tmp_path / "samples"))} == {2}


def test_status_of_an_unknown_job_and_an_unreachable_etcd(etcd_server_v3only, tmp_path):
    etcd = etcd_server_v3only
    (tmp_path / "etcd.json").write_text(json.dumps({"endpoint": etcd.endpoint, "rdzv_id": "nobody",
                                                    "rdzv_backend": "etcd-v3"}))
    run = _status(tmp_path)
    assert run.returncode == 0 and "no rendezvous state" in run.stdout and "latest checkpoint: none" in run.stdout
    from elastic_mnist.etcd.server import free_port

    (tmp_path / "etcd.json").write_text(json.dumps({"endpoint": f"127.0.0.1:{free_port()}", "rdzv_id": "x",
                                                    "rdzv_backend": "etcd-v3"}))
    run = _status(tmp_path)
    assert run.returncode == 2 and "unreachable" in run.stderr and run.stderr.strip().count("\n") == 0
