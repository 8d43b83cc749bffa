"""Sixty membership changes leave the two long-lived nodes' workers as they were after twenty: the same
process (never a fresh one), no more threads, descriptors or sockets, and no growing memory. A third node
joins and is killed or preempted, again and again; each kept worker journals what it holds at every
round's end (usage.py). The soak bench (`python -m bench --soak`) does the same over 500 changes.

    python -m pytest -q tests/e2e/test_kept_flat.py
"""

from __future__ import annotations

import statistics

import pytest

from bench import soak
from e2e.test_chaos import assert_replays_plan, launch_local
from elastic_mnist.runlog import read_records

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHANGES = 60
GAP = 12  # steps between two changes, at the least (each fires once the job recovered from the last)
# A leak of the kind this guards against cost 25-50 MB a round; the allocator's noise between rounds is
# +-20 MB, so 40 rounds cannot resolve the soak's 2 MB per 100 rounds: that is the bench's to measure.
RSS_SLACK_MB = 25.0
COLLECTIVE_TIMEOUT_S = 20
# What a process makes once, the first time it hosts a round's store (its first turn as rank 0, which may come
# after the warm-up): libuv's pipe. A leak of the kind this guards against cost 20 descriptors a round.
ONCE = {"threads": 0, "fds": 2, "sockets": 0}


def test_sixty_changes_leave_the_kept_workers_flat(tmp_path, small_mnist):
    run, report = launch_local(small_mnist, tmp_path, soak.schedule(CHANGES, hosts=False, gap=GAP),
                               "--collective-timeout", str(COLLECTIVE_TIMEOUT_S), "--epochs", "1000",
                               "--end-after-chaos", steps=100_000, timeout=600)
    # the launcher's own lines: every change, and where a change that never recovered stood (live.stuck_line)
    assert len(report["events"]) == CHANGES and report["orphans"] == [], "\n".join(
        line for line in run.stdout.splitlines() if "[local]" in line)[-4000:]
    assert all(e["recovery_s"] is not None and e["steps_redone"] == 0 for e in report["events"]), report["events"]
    result = soak.summarize(tmp_path, report, [], [])
    assert result["fresh_workers"] == 0 and not result["fallbacks"], (result["workers"], result["fallbacks"])
    for node, rows in result["rounds"].items():
        assert len(rows) >= CHANGES - 2, (node, len(rows))
        for key in ("threads", "fds", "sockets"):
            g = soak.growth(rows, key)
            assert g["growth"] <= ONCE[key], (node, key, g, [r[key] for r in rows])
        # a given-up round's groups go once their collectives end, within the collective timeout
        assert soak.longest_hold_s(rows) <= COLLECTIVE_TIMEOUT_S + 15, (node, [r["given_up"] for r in rows])
        rss = [r["rss_mb"] for r in rows if r["round"] >= soak.WARM_UP]
        assert statistics.median(rss[-10:]) <= statistics.median(rss[:10]) + RSS_SLACK_MB, (node, rss)
    assert_replays_plan(tmp_path, 1 + max(r["step"] for r in read_records(str(tmp_path / "samples"))))
