"""Issue 7: node-local checkpoint dirs (no shared storage), peer state transfer, save on failure,
in-memory snapshots; all through `elastic-mnist local` with real etcd, torchrun and signals."""

from __future__ import annotations

import pytest

from e2e.test_chaos import assert_replays_plan, launch_local, run_local
from elastic_mnist.state import format as checkpoint

pytestmark = pytest.mark.e2e
LOCAL = ("--checkpoint-storage", "local")


def _node_steps(run_dir, name: str) -> list[int]:
    return [s for s, _ in checkpoint.list_checkpoints(str(run_dir / "nodes" / name / "checkpoints"))]


def test_kill_the_rank0_node_loses_at_most_one_step(small_mnist, tmp_path):
    report = run_local(small_mnist, tmp_path, "kill:rank0@step=25", *LOCAL)
    (event,) = report["events"]
    assert event["world_size_before"] == 2 and event["world_size_after"] == 1
    assert event["steps_redone"] <= 1
    assert_replays_plan(tmp_path, 90)


def test_a_node_with_an_empty_disk_joins_and_trains_from_the_current_step(small_mnist, tmp_path):
    report = run_local(small_mnist, tmp_path, "join@step=30", *LOCAL, nodes=1, steps=150, pace=0.1)
    (join,) = report["events"]
    assert (join["world_size_before"], join["world_size_after"], join["steps_redone"]) == (1, 2, 0)
    log = (tmp_path / "nodes" / "n1.log").read_text() + (tmp_path / "nodes" / "n0.log").read_text()
    assert "sent its state to ranks" in log, "the joiner got the state over the process group"
    joined_at = min(_node_steps(tmp_path, "n1"))
    assert joined_at >= 30, "its first durable copy is the state it received, not a fresh start"
    assert max(_node_steps(tmp_path, "n1")) == 150 and max(_node_steps(tmp_path, "n0")) == 150


def test_all_nodes_die_then_the_job_resumes_from_what_any_disk_kept(small_mnist, tmp_path):
    first, _ = launch_local(small_mnist, tmp_path, "kill:n1@step=20,kill:n0@step=45", *LOCAL, steps=200)
    assert first.returncode != 0, "nobody finished: every node was killed"
    kept = max(_node_steps(tmp_path, "n0") + _node_steps(tmp_path, "n1"))
    assert kept >= 40 and max(_node_steps(tmp_path, "n1"), default=0) < kept
    report = run_local(small_mnist, tmp_path, "", *LOCAL, steps=200)
    log = (tmp_path / "nodes" / "n0.log").read_text() + (tmp_path / "nodes" / "n1.log").read_text()
    assert f"[resume] step {kept} " in log
    assert report["summary"]["global_step"] == 200


def test_a_stale_snapshot_from_an_earlier_run_is_ignored(tmp_path):
    from elastic_mnist.state.sync import best_local
    from elastic_mnist.state.writer import CheckpointWriter

    ckpt, shm = tmp_path / "ckpt", tmp_path / "shm"
    CheckpointWriter(str(ckpt), 3).save({"step": 10, "origin": {}}, 10, block=True)
    stale = {"step": 50, "origin": {"run_id": "old-job", "checkpoint_dir": str(ckpt)}}
    CheckpointWriter(str(shm), 2).save(stale, 50, block=True)
    warnings = []
    found = best_local(str(ckpt), str(shm), {"run_id": "new-job", "checkpoint_dir": str(ckpt)}, warnings.append)
    assert found.step == 10 and "belongs to another job" in warnings[0]
    fresh = {"step": 60, "origin": {"run_id": "new-job", "checkpoint_dir": str(ckpt)}}
    CheckpointWriter(str(shm), 2).save(fresh, 60, block=True)
    assert best_local(str(ckpt), str(shm), fresh["origin"], warnings.append).step == 60
