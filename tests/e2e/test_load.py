"""A loaded machine loses no live peer: the late-heartbeat probe (worker/control.py) and the agents' stale
rule (rendezvous/_liveness.py) only act on a host that is silent or an agent that does not answer, never
on a slow one. Two nodes train while busy processes (two per core) compete for every CPU.

    python -m pytest -q tests/e2e/test_load.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from e2e.test_chaos import assert_replays_plan, run_local

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def cpu_hogs():
    """Busy processes, two per core, owned by the test: stopped however it ends."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_a_loaded_machine_loses_no_live_peer(small_mnist, tmp_path, cpu_hogs):
    report = run_local(small_mnist, tmp_path, "", steps=300, pace=0.05, timeout=600)
    assert all(hog.poll() is None for hog in cpu_hogs), "the load lasted the whole run"
    journals = [json.loads(line) for path in (tmp_path / "tensorboard" / "events").glob("*.jsonl")
                for line in path.read_text().splitlines()]
    lost = [r["message"] for r in journals if r["event"] in ("peer_lost", "warning") and "peer lost" in r["message"]]
    assert lost == [], f"a live peer was declared lost under load: {lost}"
    assert {r["restart"] for r in journals} == {0}, "no worker was restarted"
    assert report["summary"]["world_size"] == 2 and all(n["restarts"] == 0 for n in report["nodes"].values())
    assert_replays_plan(tmp_path, 300)
