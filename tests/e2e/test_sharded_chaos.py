"""Sharded training (--parallel fsdp) end to end with `elastic-mnist local`: real etcd, real torchrun nodes, real
signals, each change resharded in memory by the workers that stay.

The replicated runs' contract, under sharding: a kill, a join and a preemption at once; the world goes
3 -> 2 -> 3 -> 2, every state comes from memory (no checkpoint is read), nothing is redone on the join and the
preemption, every step trains on the planned global batch, and the run ends where a fault-free replicated
run of the same model ends, within float tolerance: its losses step by step and its accuracy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, run_torchrun, worker_env
from test_precision import assert_same_state

from e2e.test_chaos import BATCH, assert_replays_plan, run_local
from elastic_mnist.runlog import read_records
from elastic_mnist.state import sharded_files
from elastic_mnist.state.format import load_latest

pytestmark = pytest.mark.e2e
STEPS = 240


def _local(data: str, run_dir, nodes: int, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "elastic_mnist", "local", "--nodes", str(nodes), "--max-nodes", "3",
           "--run-dir", str(run_dir), "--data-dir", data, "--max-steps", str(STEPS), "--global-batch-size",
           str(BATCH), "--min-step-time", "0.05", "--log-every", "20", "--checkpoint-every", "1000",
           "--collective-timeout", "10", "--timeout", "240", *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=worker_env(), cwd=REPO)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads((run_dir / "report.json").read_text())


def _losses(run_dir) -> dict[int, float]:
    """Rank 0's logged training loss by step, over every round."""
    return {r["step"]: r["loss"] for r in read_records(str(run_dir / "tensorboard" / "events"))
            if r.get("event") == "progress" and r["rank"] == 0}


def test_a_sharded_run_through_kill_join_and_preemption_reshards_in_memory_and_ends_as_ddp(small_mnist, tmp_path):
    clean = _local(small_mnist, tmp_path / "ddp", 3)
    chaos = _local(small_mnist, tmp_path / "fsdp", 3, "--parallel", "fsdp",
                   "--chaos", "kill:n2@step=20,join@step=40,term:n0@step=60")
    events = chaos["events"]
    assert [(e["kind"], e["world_size_before"], e["world_size_after"]) for e in events] == [
        ("kill", 3, 2), ("join", 2, 3), ("term", 3, 2)]
    assert events[0]["steps_redone"] <= 1 and [e["steps_redone"] for e in events[1:]] == [0, 0]
    assert all(e["breakdown"]["in_place"] for e in events), "every change kept the survivors' processes"
    journal = read_records(str(tmp_path / "fsdp" / "tensorboard" / "events"))
    resumes = [r for r in journal if r.get("event") == "resume"]
    assert resumes and all(r["source"] == "memory" for r in resumes), "no change read a checkpoint"
    waits = [r for r in journal if r.get("event") == "stop_waits"]
    assert waits and {r["node"] for r in waits} == {"n0"}, "the preempted node waited out --stop-wait, alone"
    assert chaos["summary"]["global_step"] == STEPS and chaos["orphans"] == []
    assert_replays_plan(tmp_path / "fsdp", STEPS)
    ddp, fsdp = _losses(tmp_path / "ddp"), _losses(tmp_path / "fsdp")
    assert sorted(fsdp) == sorted(ddp) == list(range(20, STEPS + 1, 20))
    assert max(abs(fsdp[s] - ddp[s]) for s in ddp) < 2e-3, (ddp, fsdp)
    assert abs(chaos["summary"]["test_accuracy"] - clean["summary"]["test_accuracy"]) <= 0.004
    assert chaos["summary"]["test_accuracy"] > 0.85
    assert json.loads((tmp_path / "fsdp" / "etcd.json").read_text())["v2_api"] is False, "etcd-v3 needs no v2 API"


TASK = str(REPO / "tests" / "sharded_task.py")
TASK_FLAGS = ("--script", TASK, "--parallel", "fsdp", "--precision", "bf16", "--grad-accum", "2")
TASK_STEPS = 60


def test_a_users_own_task_on_a_vanished_host_ends_bit_for_bit_where_a_fault_free_run_at_the_same_sizes_does(
        small_mnist, tmp_path):
    """Dropout, AdamW, a step schedule and a counter of its own, bf16, accumulation: a host vanishes (no reset:
    FSDP2's collective waits inside torch until its connections are cut) at world 3 and the rest reshard in
    memory to 2, against a run without a fault that trains at 3 up to the same step, then resumes from its
    DCP checkpoint at 2."""
    chaos = tmp_path / "chaos"
    report = run_local(small_mnist, chaos, "vanish:n2@step=20", "--hosts", *TASK_FLAGS, steps=TASK_STEPS, nodes=3)
    (event,) = report["events"]
    assert (event["kind"], event["world_size_before"], event["world_size_after"]) == ("vanish", 3, 2)
    records = read_records(str(chaos / "tensorboard" / "events"))
    assert [r["source"] for r in records if r.get("event") == "resume"] == ["memory"] * 2, "the survivors kept it"
    assert not [r for r in records if r.get("event") == "saved_by_watch"], "no survivor gave its process up"
    assert_replays_plan(chaos, TASK_STEPS)
    resumed_at = min(r["step"] for r in read_records(str(chaos / "samples")) if r["world_size"] == 2)
    common = ["--data-dir", small_mnist, "--checkpoint-dir", str(tmp_path / "ref"), "--log-dir", str(tmp_path / "runs"),
              "--global-batch-size", str(BATCH), "--checkpoint-every", "0", *TASK_FLAGS[2:]]
    for nproc, steps in ((3, resumed_at), (2, TASK_STEPS)):
        run = run_torchrun(["--standalone", f"--nproc-per-node={nproc}"], [*common, "--max-steps", str(steps)],
                           script=TASK)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got, want = _final(chaos / "checkpoints"), _final(tmp_path / "ref")
    assert got["step"] == want["step"] == TASK_STEPS and got["counter"]["count"] == TASK_STEPS
    assert want["fingerprint"]["task"] == "mnist-mlp-dropout"
    assert_same_state(want, got, keys=("model", "optimizer", "scheduler", "counter"))


def _final(directory) -> dict:
    """The newest checkpoint of a sharded run, its shards read whole: as a replicated run's state."""
    state = load_latest(str(directory))[0]
    return sharded_files.read_whole(str(directory), state)
