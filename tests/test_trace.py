"""The spot-trace replay's parsing and its goodput arithmetic, on small hand-made runs (no processes).

    PYTHONPATH=. python -m pytest -q tests/test_trace.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from elastic_mnist.config import TrainConfig
from elastic_mnist.contract.errors import UserError
from elastic_mnist.local import goodput
from elastic_mnist.local.flags import parse
from elastic_mnist.local.launcher import Launcher
from elastic_mnist.local.nodes import Node
from elastic_mnist.local.trace import load_trace, parse_window
from elastic_mnist.procs import child_env
from elastic_mnist.state import snapshots


def _trace(tmp_path, data, gap=300):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": gap}, "data": data}))
    return str(path)


def test_trace_loads_and_windows(tmp_path):
    tr = load_trace(_trace(tmp_path, [4, 3, 0, 2]))
    assert (tr.gap_s, tr.counts) == (300.0, [4, 3, 0, 2])
    assert parse_window("1:3", 4) == (1, 3) and parse_window("", 4) == (0, 4)
    for bad in ("3:2", "x", "-1:2", "0:0"):
        with pytest.raises(UserError, match="--trace-window"):
            parse_window(bad, 4)


@pytest.mark.parametrize("doc", ['{"data": [1]}', '{"metadata": {"gap_seconds": 300}, "data": [1, -1]}', "nope"])
def test_a_bad_trace_is_one_clear_error(tmp_path, doc):
    path = tmp_path / "bad.json"
    path.write_text(doc)
    with pytest.raises(UserError, match="--trace"):
        load_trace(str(path))


def test_launcher_flags_load_the_window_and_check_the_node_cap(tmp_path):
    path = _trace(tmp_path, [1, 2, 4, 0])
    args, *_ = parse(["--trace", path, "--trace-window", "0:2", "--max-nodes", "2", "--run-dir", str(tmp_path / "run")])
    assert (args.trace_counts, args.nodes) == ([1, 2], 0), "the replay starts every node itself"
    with pytest.raises(UserError, match="--max-nodes"):
        parse(["--trace", path, "--max-nodes", "2", "--run-dir", str(tmp_path / "run")])
    with pytest.raises(UserError, match="--chaos"):
        parse(["--trace", path, "--chaos", "kill:n0@step=1", "--run-dir", str(tmp_path / "run")])


def test_interval_arithmetic():
    assert goodput.merge([(3, 4), (0, 2), (1, 3)]) == [(0, 4)]
    assert goodput.intersect([(0, 5)], [(1, 2), (4, 7)]) == [(1, 2), (4, 5)]
    assert goodput.subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert goodput.length([(0, 1), (0.5, 2)]) == 2


def _run() -> goodput.Run:
    """0-10 s: 1 node, steps 0-3 (1 s each after a 2 s start); 10-14 s: no node; 14-20 s: 1 node, a new
    worker redoes step 3 and does 4."""
    def rec(pid, step, t):
        return {"pid": pid, "rank": 0, "world_size": 1, "step": step, "time": t}

    def start(pid, t0):
        return {"event": "startup", "pid": pid, "rank": 0, "time": t0 + 2,
                "phases": {"process_start": t0, "imports": t0 + 0.5, "startup_cost": t0 + 1.0, "resumed": t0 + 1.5}}

    processes = {(1, 0): [rec(1, s, 3.5 + s) for s in range(4)], (2, 0): [rec(2, 3, 17.0), rec(2, 4, 18.0)]}
    journal = [start(1, 1.0), start(2, 15.0), {"event": "stop", "pid": 1, "rank": 0, "time": 7.0}]
    events = [{"kind": "join", "node": "n0", "time": 0.0, "recovery_s": 3.5},
              {"kind": "preempt", "node": "n0", "time": 10.0, "recovery_s": None},
              {"kind": "join", "node": "n1", "time": 14.0, "recovery_s": 3.0}]
    return goodput.Run(timeline=[(0.0, 1), (10.0, 0), (14.0, 1)], end=20.0, processes=processes, journal=journal,
                       events=events, batch=10, per_node=1, tick_s=2.0, gap_s=300.0, ticks=[1] * 5 + [0] * 2 + [1] * 3)


def test_the_parts_tile_the_wall_time():
    acc = goodput.account(_run(), startup_cost_s=0.5)
    p = acc["parts_s"]
    assert acc["parts_sum_s"] == pytest.approx(acc["wall_s"]) == 20
    assert p["no_node"] == 4
    # steps: 0 from resume (2.5) to 3.5, then 1 s each to 6.5; the new worker's step 3 (16.5-17) is redone
    assert p["productive"] == pytest.approx(4 + 1) and p["redone"] == pytest.approx(0.5)
    assert p["worker_start"] == pytest.approx(2 * 1.0) and p["resume"] == pytest.approx(2 * 0.5)
    assert acc["ettr"] == pytest.approx(5 / 16)
    assert acc["useful_samples"] == 50 and acc["samples_per_s_by_world"] == {"1": 10.0}
    assert acc["capacity_samples"] == 160 and acc["goodput"] == pytest.approx(50 / 160)


def test_a_round_served_in_place_counts_no_worker_start():
    """The second worker's round is served by a kept process (its phases: the stand-in's start and the attach):
    the accounting takes it, and it paid no start-up cost."""
    run = _run()
    kept = {"event": "startup", "pid": 2, "round": 0, "rank": 0, "time": 17.0,
            "phases": {"stand_in": 15.0, "attached": 15.2, "process_group": 15.3, "resumed": 15.5}}
    run.journal[1] = kept
    acc = goodput.account(run, startup_cost_s=0.5)
    assert acc["parts_sum_s"] == pytest.approx(acc["wall_s"])
    assert acc["events"][2]["worker_starts"] == 0 and acc["parts_s"]["worker_start"] == pytest.approx(1.0 + 0.2)


def test_each_change_costs_its_window_and_real_scale_uses_real_intervals():
    acc = goodput.account(_run(), startup_cost_s=0.5)
    first, to_zero, back = acc["events"]
    assert first["cost_s"] == pytest.approx(10 - 4)  # everything but steps 0-3 before the drop
    assert to_zero["cost_s"] == 0 and to_zero["recovered"], "a drop to no node costs nothing but no_node"
    assert back["cost_s"] == pytest.approx(6 - 1) and back["worker_starts"] == 1
    rs = acc["real_scale"]
    assert rs["real_available_s"] == 8 * 300
    assert rs["ettr"] == pytest.approx(1 - 11 / 2400, abs=1e-4)
    assert rs["ettr_without_startup_cost"] == pytest.approx(1 - 10 / 2400, abs=1e-4)
    assert [s["nodes"] for s in acc["series"]] == [1] * 5 + [0] * 2 + [1] * 3
    assert acc["series"][-1]["useful_samples"] == 50


def _spared(pid: int) -> bool:
    """Neither dead (a SIGKILLed child is a zombie until reaped) nor with a SIGKILL pending (delivery
    follows the kill call by a moment)."""
    try:
        status = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":\t" in line)
    except FileNotFoundError:
        return False
    pending = int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)
    return status["State"][0] not in "ZX" and not pending >> (signal.SIGKILL - 1) & 1


@pytest.fixture(autouse=True)
def _memory_removed():
    """The stand-in nodes keep their "memory" where a real run's does (the per-user /dev/shm root); the
    test owns what it made there: removed after it, the root too when this test created it."""
    root = snapshots.root_of(TrainConfig().snapshot_dir)
    existed = os.path.isdir(root)
    before = set(os.listdir(root)) if existed else set()
    yield
    if os.path.isdir(root):
        for name in set(os.listdir(root)) - before:
            if name.startswith("local-"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        if not existed and not os.listdir(root):
            os.rmdir(root)


class _StandInLauncher(Launcher):
    """The real launcher whose nodes are real processes that only wait to be signalled (no torchrun)."""

    def start_node(self) -> Node:
        name = f"n{len(self.nodes)}"
        node = Node(name, ["sleep", "120"], child_env(), self.args.run_dir)
        node.start()
        os.makedirs(self.node_config(name).snapshot_dir, exist_ok=True)  # the machine's memory
        self.nodes[name] = node
        return node


def _replay(tmp_path, seed: int, *argv: str) -> _StandInLauncher:
    path = _trace(tmp_path, [3, 1, 1, 2, 0])
    launcher = _StandInLauncher(*parse(["--trace", path, "--run-dir", str(tmp_path / f"run{seed}"),
                                        "--trace-seed", str(seed), "--notice", "1.5", *argv]))
    return launcher


def _close(launcher) -> None:
    for node in launcher.nodes.values():
        node.shutdown(grace_s=5)
    shutil.rmtree(launcher.shm_root, ignore_errors=True)


def _drive(launcher, t0: float, until: float) -> None:
    """The poll loop's calls at chosen times: the replay reads no clock of its own."""
    for k in range(int(until * 2) + 1):
        launcher.replay.tick(t0 + k / 2)


def test_the_node_count_follows_the_trace_with_seeded_preemptions_and_notice(tmp_path):
    launcher = _replay(tmp_path, 7, "--tick", "1")
    t0 = 1000.0
    try:
        launcher.replay.tick(t0)
        assert sorted(launcher.nodes) == ["n0", "n1", "n2"]
        launcher.replay.tick(t0 + 1)
        gone = [e.node for e in launcher.events if e.kind == "preempt"]
        assert len(gone) == 2 and all(launcher.nodes[n].injected for n in gone)
        for n in gone:  # SIGTERM first: the notice
            assert launcher.nodes[n].proc.wait(timeout=30) == -15
            assert os.path.isdir(launcher.node_config(n).snapshot_dir), "memory kept during the notice"
        launcher.replay.tick(t0 + 2.5)  # notice over: the machines are gone, their memory with them
        assert not any(os.path.exists(launcher.node_config(n).snapshot_dir) for n in gone)
        _drive(launcher, t0 + 3, 2)
        kinds = [(e.kind, e.node) for e in launcher.events]
        assert kinds[5] == ("join", "n3") and len(launcher.replay.live) == 0
        assert [c for _, c in launcher.replay.timeline] == [3, 1, 2, 0] and launcher.replay.window_done
        assert launcher.replay.over()
    finally:
        _close(launcher)
    again = _replay(tmp_path, 7, "--tick", "1")
    try:
        again.replay.tick(t0)
        again.replay.tick(t0 + 1)
        assert [e.node for e in again.events if e.kind == "preempt"] == gone, "the same seed, the same nodes"
    finally:
        _close(again)


def test_restart_all_kills_the_whole_job_at_every_change(tmp_path):
    launcher = _replay(tmp_path, 0, "--tick", "1", "--on-change", "restart-all")
    try:
        launcher.replay.tick(0.0)
        first_id = launcher.run_id
        old = [launcher.nodes[n] for n in ("n0", "n1", "n2")]
        reaped_while = []  # at each node's clean-up: which of the old nodes were spared so far
        launcher.replay._clean_up = lambda node: (reaped_while.append([_spared(n.proc.pid) for n in old]),
                                                  type(launcher.replay)._clean_up(launcher.replay, node))
        launcher.replay.tick(1.0)
        assert all(n.returncode == -9 for n in old), "no notice, no save"
        assert reaped_while == [[False] * 3] * 3, "every node was dead before the first one was cleaned up"
        assert [n.name for n in launcher.replay.live] == ["n3"] and launcher.run_id != first_id
        assert (launcher.args.min_nodes, launcher.args.max_nodes) == (1, 1), "a static job at the new size"
    finally:
        _close(launcher)


def test_the_workload_profile_and_the_c10d_baseline_flags():
    from elastic_mnist.config import parse_args
    from elastic_mnist.contract.torchrun import torchrun_args

    assert parse_args(["--startup-cost", "8", "--min-step-time", "0.3"]).startup_cost == 8
    with pytest.raises(UserError, match="--startup-cost"):
        parse_args(["--startup-cost", "-1"])
    c10d = torchrun_args("c10d", "127.0.0.1:29400", "job")
    assert "--rdzv-backend=c10d" in c10d and not any(a.startswith("--rdzv-conf") for a in c10d), "torch's defaults"
