"""A spot trace replayed end to end: `elastic-mnist local --trace` on real etcd and torchrun nodes, a
short window that drops to no node and comes back, with a preemption notice.

    PYTHONPATH=. python -m pytest -q tests/e2e/test_trace_replay.py
"""

from __future__ import annotations

import json
import os

import pytest

from e2e.test_chaos import assert_replays_plan, launch_local

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Two nodes, one preempted, then none for two intervals (the job's memory gone with them), then one
# again: the shape of the real trace's drops (../shared/spot-traces), short enough for CI.
COUNTS = [2, 2, 2, 2, 1, 0, 0, 1, 1, 1, 1, 1, 1]
STEPS = 300  # of the 310 the small set allows
PACE = 0.08  # s a step: 24 s of training, so that it is still going when the count drops to 0 (at 20 s) and
# ends inside the window (52 s) after the 8 s without a node and a cold start


def test_trace_window_with_a_drop_to_zero_trains_to_the_end(small_mnist, tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": [3, *COUNTS]}))
    run_dir = tmp_path / "run"
    run, report = launch_local(small_mnist, run_dir, "", "--trace", str(trace), "--trace-window",
                               f"1:{len(COUNTS)}", "--tick", "4", "--notice", "2", "--startup-cost", "0.5",
                               nodes=1, steps=STEPS, timeout=200, pace=PACE)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert report["summary"]["global_step"] == STEPS, "the job finished inside the window"
    assert report["orphans"] == []
    assert [c for _, c in report["trace"]["timeline"]] == [2, 1, 0, 1], "the node count followed the trace"
    kinds = [(e["kind"], e["world_size_after"]) for e in report["events"] if e["kind"] != "agent-restart"]
    assert kinds[:2] == [("join", 2), ("join", 2)] and ("preempt", 1) in kinds, kinds
    g = report["goodput"]
    assert abs(g["parts_sum_s"] - g["wall_s"]) <= 0.02 * g["wall_s"], "the parts add up to the wall time"
    assert g["parts_s"]["no_node"] == pytest.approx(8, abs=1), "two intervals of 4 s without a node"
    assert g["parts_s"]["productive"] > 0 and 0 < g["ettr"] < 1 and 0 < g["goodput"] <= 1.05
    assert g["useful_samples"] == STEPS * 64
    assert report["profile"]["startup_cost_s"] == 0.5
    trained_before = [e for e in report["events"] if e["kind"] == "preempt" and e["at_step"] > 0]
    assert trained_before, "training had started before the drop, so the run resumed across it"
    assert_replays_plan(run_dir, STEPS)
    assert os.path.isdir(run_dir / "tensorboard" / "goodput")
