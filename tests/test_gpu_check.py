"""The GPU check script cannot rot on machines without a GPU: its dry run does every step on CPU."""

import json
import subprocess
import sys

import pytest
from conftest import REPO, worker_env


@pytest.mark.slow
def test_gpu_check_dry_run_trains_resumes_measures_and_survives_a_peer_loss(small_mnist, tmp_path):
    out = tmp_path / "gpu_check.json"
    run = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--data-dir", small_mnist, "--dry-run",
                          "--out", str(out), "--work-dir", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=600, env=worker_env(), cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["train_and_resume"]["resumed_at"] == 200 and result["train_and_resume"]["final_step"] == 400
    assert result["throughput"]["ours_vs_bare"] > 0
    assert result["precision"]["ok"] and result["precision"]["fp16"]["resumed_at"] == 25
    sharded = result["sharded"]  # --parallel fsdp at world 1, resumed from its own DCP checkpoint
    assert sharded["ok"] and sharded["resumed_at"] == 25 and sharded["shards"] and sharded["samples_per_s"] > 0
    assert result["in_process"]["ok"] and result["in_process"]["resume_and_abort"]["saved_step"] == 22
    loss = result["peer_loss"]
    assert loss["completed"] and loss["steps_redone"] <= 1 and loss["detection_s"] < 5 and loss["saved_by"]
    resized = result["resizes"]  # in place: node 0 served four rounds with one process (one CUDA context)
    n0 = resized["nodes"]["n0"]
    assert resized["ok"] and (n0["processes"], n0["cuda_contexts_at_most"], n0["nccl_communicators"]) == (1, 1, 0)
    assert n0["rounds"] >= 4, "2 nodes, the kill, the join, the SIGTERM (and a first round alone if n0 was first)"
    assert resized["nodes"]["n1"]["processes"] == 2, "the killed worker and the joiner's"
