"""Recovery and time to accuracy, both through `elastic-mnist local` (embedded etcd + real torchrun
nodes): what a fault costs, against the cold start of the same job, and when training reaches 98%.

    python -m elastic_mnist local --nodes 2 --max-nodes 2 --chaos 'kill:n1@step=60' ...   # what runs here
"""

from __future__ import annotations

import json

from bench.runner import BenchError, Runner, log, python_m, ratio, shown, spread
from bench.settings import HOST_SCENARIOS, REPEATED_SCENARIOS, Settings

BREAKDOWN = ("detection_s", "rendezvous_s", "attach_s", "process_group_s", "state_s", "first_step_s")


def scenario(name: str, s: Settings) -> tuple[int, str, int]:
    """(nodes at launch, chaos schedule, max steps) of a recovery scenario."""
    f = s.fault_step
    if name == "join":
        return 1, f"join@step={f}", s.recovery_steps
    if name == "partition":  # n0 and n1 lose each other, both still reach etcd; healed 15 s later
        return 2, f"cut:n0-n1@step={f},heal@after=15s", f + 700
    if name == "stop":  # the frozen node is resumed once the job has recovered without it; the legacy
        # backend takes up to ~25 s to readmit it, so the run goes on 30 s (600 paced steps) past the cont
        return 2, f"stop:n1@step={f}+cont@step={f + 60}", f + 60 + 600
    return 2, f"{name}:n1@step={f}", s.recovery_steps


def run_local(runner: Runner, s: Settings, name: str, nodes: int, max_nodes: int, chaos: str,
              train: list[str], backend: str = "etcd-v3", hosts: bool = False) -> dict:
    """One `elastic-mnist local` run (`hosts`: each node on a host of its own); its report.json, plus how
    it was run."""
    run_dir = runner.new_dir(name)
    # The launcher's own limit must end the run first, so that it writes a report: stopping its nodes can
    # take it over 30 s (c10d's chain, which never drops the frozen node, ran into the bench's limit).
    cmd = python_m("elastic_mnist") + [
        "local", "--nodes", str(nodes), "--max-nodes", str(max_nodes), "--rdzv-backend", backend,
        *(["--hosts"] if hosts else []),
        "--run-dir", str(run_dir / "run"), "--timeout", str(int(s.timeout_s - 90)), "--chaos", chaos,
        "--data-dir", s.data_dir, "--global-batch-size", str(s.global_batch_size), *train]
    rc, wall, load = runner.run(cmd, run_dir / "launcher.log", s.timeout_s)
    report_path = run_dir / "run" / "report.json"
    if not report_path.exists():
        text = (run_dir / "launcher.log").read_text(errors="replace")
        raise BenchError(f"{shown(cmd)} exited {rc} without report.json:\n{text[-3000:]}")
    report = json.loads(report_path.read_text())
    return {"report": report, "exit_code": rc, "wall_s": round(wall, 2), "load_avg": load, "command": shown(cmd)}


def _event(e: dict, cold_start: float | None) -> dict:
    keep = ("kind", "node", "at_step", "world_size_before", "world_size_after", "recovery_s", "stall_s",
            "steps_redone")
    out = {k: e.get(k) for k in keep}
    out["breakdown"] = {k: (e.get("breakdown") or {}).get(k) for k in BREAKDOWN} if e.get("breakdown") else None
    out["recovery_over_cold_start"] = ratio(e.get("recovery_s"), cold_start)
    return out


def repeats(s: Settings, name: str, backend: str) -> int:
    if name in HOST_SCENARIOS:
        return s.host_repeats if backend == "etcd-v3" else 0
    return s.recovery_repeats if name in REPEATED_SCENARIOS and backend == "etcd-v3" else 1


def measure_recovery(runner: Runner, s: Settings) -> dict:
    """Each scenario on each backend; backends alternate so neither always runs on a quieter machine,
    and the repeats of a scenario are interleaved across backends for the same reason."""
    results = []
    for i, name in enumerate(s.scenarios):
        backends = s.backends if i % 2 == 0 else s.backends[::-1]
        for repeat in range(max(repeats(s, name, b) for b in backends)):
            for backend in (b for b in backends if repeat < repeats(s, name, b)):
                results.append(_recovery_run(runner, s, name, backend, repeat))
    return {"max_steps": s.recovery_steps, "fault_step": s.fault_step, "min_step_time_s": 0.05,
            "collective_timeout_s": 10, "runs": results, "summary": summarize(results)}


def _recovery_run(runner: Runner, s: Settings, name: str, backend: str, repeat: int) -> dict:
    nodes, chaos, steps = scenario(name, s)
    log(f"recovery: {name} on {backend} #{repeat + 1} ({nodes} node(s), chaos {chaos!r}, {steps} steps) ...")
    # Paced steps so the fault lands mid-run; a 10 s collective timeout bounds a freeze's detection.
    train = ["--max-steps", str(steps), "--min-step-time", "0.05", "--collective-timeout", "10"]
    run = run_local(runner, s, f"recovery-{name}-{backend}-{repeat}", nodes, 2, chaos, train, backend,
                    hosts=name in HOST_SCENARIOS)
    rep = run["report"]
    rec = {"scenario": name, "backend": backend, "repeat": repeat, "nodes": nodes, "max_nodes": 2, "chaos": chaos,
           "cold_start_s": rep.get("cold_start_s"), "orphans": rep.get("orphans"),
           "final_step": (rep.get("summary") or {}).get("global_step"), "max_steps": steps,
           "events": [_event(e, rep.get("cold_start_s")) for e in rep.get("events", [])],
           **{k: run[k] for k in ("exit_code", "wall_s", "load_avg", "command")}}
    for e in rec["events"]:
        log(f"  {name}/{backend} {e['kind']}: world {e['world_size_before']}->{e['world_size_after']}, "
            f"recovery {_s(e['recovery_s'])} (cold start {_s(rec['cold_start_s'])}), "
            f"steps redone {e['steps_redone']}, breakdown {e['breakdown']}")
    return rec


def summarize(runs: list[dict]) -> list[dict]:
    """Per (scenario, backend, event): recovery and each part of it as median (min-max) of the runs,
    and the most steps any run redid."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        for e in run["events"]:
            groups.setdefault((run["scenario"], run["backend"], e["kind"]), []).append(e)
    return [{"scenario": sc, "backend": b, "kind": k, "n": len(es),
             "world": f"{es[0]['world_size_before']}->{es[0]['world_size_after']}",
             "recovery_s": spread([e["recovery_s"] for e in es]),
             "steps_redone_max": max((e["steps_redone"] for e in es if e["steps_redone"] is not None), default=None),
             "breakdown": {p: spread([(e["breakdown"] or {}).get(p) for e in es]).get("median") for p in BREAKDOWN}}
            for (sc, b, k), es in groups.items()]


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def tta_runs(s: Settings) -> list[tuple[str, int, str]]:
    """(name, nodes, chaos): world 1, world 2, and world 2 losing a node mid-epoch 2 then regaining one."""
    spe = 60000 // s.global_batch_size
    return [("world1", 1, ""), ("world2", 2, ""),
            ("world2-kill-join", 2, f"kill:n1@step={spe + spe // 2},join@step={3 * spe}")]


def measure_tta(runner: Runner, s: Settings) -> dict:
    runs = []
    for name, nodes, chaos in tta_runs(s):
        log(f"time to accuracy: {name} ({s.tta_epochs} epochs, chaos {chaos or 'none'!r}) ...")
        run = run_local(runner, s, f"tta-{name}", nodes, nodes, chaos, ["--epochs", str(s.tta_epochs)])
        rep = run["report"]
        curve = eval_curve(rep)
        hits = {f"{t:.2f}": first_reaching(curve, t) for t in (0.97, s.tta_threshold)}
        hit = hits[f"{s.tta_threshold:.2f}"]
        rec = {"name": name, "nodes": nodes, "chaos": chaos, "tta_s": hit["t_s"] if hit else None,
               "reached_at_step": hit["step"] if hit else None,
               # A lower bar too: runs stay comparable when one ends just under the main threshold.
               "tta_s_by_threshold": {k: (h["t_s"] if h else None) for k, h in hits.items()},
               "final_accuracy": curve[-1]["test_accuracy"] if curve else None,
               "best_accuracy": max((e["test_accuracy"] for e in curve), default=None), "curve": curve,
               "events": [{"kind": e["kind"], "node": e["node"], "t_s": round(e["time"] - rep["launched_at"], 3),
                           "world_size_after": e["world_size_after"], "recovery_s": e["recovery_s"]}
                          for e in rep.get("events", [])],
               "samples_per_s": (rep.get("summary") or {}).get("samples_per_s"),
               **{k: run[k] for k in ("exit_code", "wall_s", "load_avg", "command")}}
        runs.append(rec)
        log(f"  {name}: {s.tta_threshold:.0%} at {_s(rec['tta_s'])} (step {rec['reached_at_step']}), "
            f"final accuracy {rec['final_accuracy']}")
    return {"threshold": s.tta_threshold, "epochs": s.tta_epochs, "runs": runs,
            "clock": "seconds from the launcher's start (etcd start included) to the evaluation's end"}


def first_reaching(curve: list[dict], threshold: float) -> dict | None:
    return next((e for e in curve if e["test_accuracy"] >= threshold), None)


def eval_curve(report: dict) -> list[dict]:
    """One point per evaluated step (every rank journals the same eval; a redone step keeps its first)."""
    first: dict[int, dict] = {}
    for e in sorted(report.get("evals", []), key=lambda e: e["time"]):
        first.setdefault(e["step"], e)
    return [{"step": e["step"], "t_s": round(e["time"] - report["launched_at"], 3),
             "test_accuracy": e["test_accuracy"], "world_size": e["world_size"]}
            for e in sorted(first.values(), key=lambda e: e["time"])]
