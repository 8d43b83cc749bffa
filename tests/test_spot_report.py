"""The whole-trace replay's report: its targets (real-scale ETTR, lasting the trace), its text, and the kept
workers' growth read from real journal lines (no processes: the replay itself is a benchmark)."""

from __future__ import annotations

import json
from dataclasses import asdict

from bench import spot

PARTS = dict.fromkeys(spot.PART_NAMES, 1.0)


def _system(name: str, ettr: float, real: float, exit_code: int = 0, done: bool = True, kept=None) -> dict:
    goodput = {"ettr": ettr, "goodput": ettr, "parts_s": PARTS, "events": [{}] * 5, "series": [],
               "real_scale": {"ettr": real, "ettr_without_startup_cost": real, "label": "extrapolated"}}
    return {"system": name, "exit_code": exit_code, "steps_done": 10, "goodput": goodput, "changes": 5,
            "window_done": done, "store_hosts": [], "agent_restarts": 0, "kept": kept}


def _result(ours: float, done: bool = True, kept=None) -> dict:
    settings = asdict(spot.SpotSettings("/data", window=""))
    result = {"settings": settings, "plan": {"ok": True, "records": 1, "mismatched": 0, "steps": 10},
              "accuracy": {"skipped": "no checkpoint"},
              "systems": [_system("elastic", 0.5, ours, done=done, kept=kept), _system("c10d", 0.1, 0.99),
                          _system("restart", 0.1, 0.98)]}
    result["targets"] = spot.judge(result)
    return result


def test_the_whole_trace_is_judged_on_real_scale_ettr_and_on_lasting_the_trace():
    met = {t["id"]: t["met"] for t in _result(0.9985)["targets"]}
    assert met["spot_whole_ettr"] and met["spot_whole_survived"] and met["spot_better"]
    assert not {t["id"]: t["met"] for t in _result(0.9975)["targets"]}["spot_whole_ettr"]
    assert not {t["id"]: t["met"] for t in _result(0.9985, done=False)["targets"]}["spot_whole_survived"]
    window = _result(0.9985)
    window["settings"]["window"] = "2136:100"
    assert "spot_whole_ettr" not in {t["id"] for t in spot.judge(window)}


def test_the_text_names_the_whole_trace_and_what_the_kept_workers_did():
    text = spot.render(_result(0.9985, kept={"workers": {}, "rounds_max": 7}))
    assert text.startswith("The whole trace (5 changes)") and "spot-whole.png" in text
    assert "No kept worker served 30 rounds (the longest-lived served 7)" in text


def test_kept_growth_reads_each_kept_workers_rounds_from_its_journal(tmp_path):
    events = tmp_path / "tensorboard" / "events"
    events.mkdir(parents=True)
    lines = [{"event": "round_end", "node": "n0", "pid": 11, "round": r, "time": float(r), "threads": 30,
              "fds": 40 + (r >= 35), "sockets": 9, "rss_mb": 600.0 + 0.1 * r} for r in range(45)]
    lines += [{"event": "round_end", "node": "n1", "pid": 12, "round": r, "time": float(r), "threads": 30,
               "fds": 40, "sockets": 9, "rss_mb": 600.0} for r in range(5)]  # too few rounds to judge
    (events / "rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    kept = spot.kept_growth(tmp_path)
    assert list(kept["workers"]) == ["n0/11"] and kept["rounds_max"] == 45
    assert kept["worst_rss_mb_per_100"] == 10.0 and kept["worst_fds"] == 1 and kept["worst_threads"] == 0
