"""examples/ema_mnist.py (its own SGD, scheduler and EMA) under `elastic-mnist local --script`: a node is
killed mid-run; the sample logs replay the plan, and model, optimizer, scheduler and EMA end bit-for-bit
where a run with the same world sizes and no fault does (world 2 up to the resumed step, then world 1:
the same sums in the same order, so nothing needs a tolerance).

    .venv/bin/python -m pytest -q tests/e2e/test_example_state.py
"""

from __future__ import annotations

import pytest
from conftest import REPO, run_torchrun
from test_precision import assert_same_state

from e2e.test_chaos import BATCH, assert_replays_plan, run_local
from elastic_mnist.runlog import read_records
from elastic_mnist.state.format import load_latest

pytestmark = pytest.mark.e2e
SCRIPT = str(REPO / "examples" / "ema_mnist.py")
STEPS, LR = 60, "0.05"


def _reference(data: str, work, resumed_at: int) -> dict:
    common = ["--data-dir", data, "--checkpoint-dir", str(work / "ckpt"), "--log-dir", str(work / "runs"),
              "--global-batch-size", str(BATCH), "--lr", LR, "--checkpoint-every", "0", "--snapshot-every", "0"]
    for nproc, steps in ((2, resumed_at), (1, STEPS)):
        run = run_torchrun(["--standalone", f"--nproc-per-node={nproc}"], [*common, "--max-steps", str(steps)],
                           script=SCRIPT)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return load_latest(str(work / "ckpt"))[0]


def test_an_examples_own_optimizer_scheduler_and_ema_continue_exactly_after_a_kill(small_mnist, tmp_path):
    report = run_local(small_mnist, tmp_path / "chaos", "kill:n1@step=20", "--script", SCRIPT, "--lr", LR,
                       steps=STEPS)
    (event,) = report["events"]
    assert (event["kind"], event["world_size_before"], event["world_size_after"]) == ("kill", 2, 1)
    assert_replays_plan(tmp_path / "chaos", STEPS)
    resumed_at = min(r["step"] for r in read_records(str(tmp_path / "chaos" / "samples")) if r["world_size"] == 1)
    state = load_latest(str(tmp_path / "chaos" / "checkpoints"))[0]
    assert state["fingerprint"]["task"] == "mnist-mlp-ema" and state["step"] == STEPS
    assert state["ema"]["updates"] == STEPS and state["scheduler"]["last_epoch"] == STEPS
    assert "momentum_buffer" in state["optimizer"]["state"][0], "torch.optim.SGD's own state"
    assert_same_state(_reference(small_mnist, tmp_path / "reference", resumed_at), state,
                      keys=("model", "optimizer", "scheduler", "ema"))
