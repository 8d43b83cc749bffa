"""Recovery in place against a fresh start and torchrun's c10d: what each membership change stalls the job, with
and without a real job's start-up cost, and a storm of changes.

    python -m bench --in-place-only --data-dir ../shared/data --update-docs     # ~80 min on 2 cores (root: vanish)

Three modes run the same worker: `in-place` (etcd-v3's default: survivors keep their process), `fresh` (etcd-v3,
`--rdzv-conf in_place=0`: every round a new warm worker) and `c10d` (torch's backend, cold workers). Each run of
`elastic-mnist local` takes a chain of changes, each fired once the job recovered from the one before:
kill n1, join, SIGTERM to the joiner's agent, join, SIGSTOP of that joiner's every process (resumed 60 steps
later); with --hosts (root; in-place and fresh: c10d's store cannot reach hosts) a vanishing host, then a join.
n0 stays up throughout (c10d keeps its store in n0's agent). Five runs of each, with --startup-cost 0 and 8
(what a GPU job pays per process: CUDA context, NCCL, model load). The stall is from the last step anyone
trained before the change to the first at the new size. The storm: a kill or a join every 15 s for 5 minutes
(a trace of 2, 1, 2, ... nodes) with --startup-cost 8, ETTR per mode. The frozen node of plain torchrun: two
torchrun agents with the README's etcd-v3 command and `--rdzv-conf last_call_timeout=2`, every process of one
SIGSTOPped, five runs.

Writes OUT/inplace.json and OUT/inplace.md; --update-docs puts the tables between `<!-- inplace:start -->` and
`<!-- inplace:end -->` in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import elastic, report
from bench.fmt import pct, sec
from bench.runner import BenchError, Runner, log, median, spread

START, END = "<!-- inplace:start -->", "<!-- inplace:end -->"
MODES = {"in-place": ("etcd-v3", ""), "fresh": ("etcd-v3", "in_place=0"), "c10d": ("c10d", "")}
EVENTS = ("kill", "term", "join", "vanish", "stop")
LABELS = {"kill": "kill (SIGKILL)", "term": "preemption (SIGTERM to the agent)", "join": "join: running nodes' stall",
          "vanish": "host vanishes", "stop": "frozen node (SIGSTOP)"}


@dataclass
class InPlaceSettings:
    data_dir: str
    repeats: int = 3
    c10d_repeats: int = 1  # c10d's chain takes 6-10 minutes (its agents exit and restart on most changes)
    costs: tuple = (0.0, 8.0)
    min_step_time: float = 0.05
    global_batch_size: int = 128
    storm_intervals: int = 20
    storm_tick_s: float = 15.0
    timeout_s: float = 420.0
    c10d_timeout_s: float = 900.0


def chain(first: int = 60, every: int = 60) -> str:
    steps = [first + i * every for i in range(5)]
    return (f"kill:n1@step={steps[0]},join@step={steps[1]},term:n2@step={steps[2]},join@step={steps[3]},"
            f"stop:n3@step={steps[4]}+cont@step={steps[4] + 60}")


def _run(runner: Runner, s: InPlaceSettings, mode: str, cost: float, repeat: int, hosts: bool) -> dict:
    backend, conf = MODES[mode]
    chaos = "vanish:n1@step=60,join@step=120" if hosts else chain()
    train = ["--max-steps", "100000", "--min-step-time", str(s.min_step_time), "--collective-timeout", "10",
             "--startup-cost", str(cost), "--end-after-chaos", *(["--rdzv-conf", conf] if conf else [])]
    name = f"inplace-{mode}-{int(cost)}-{'hosts' if hosts else 'chain'}-{repeat}"
    log(f"in place: {mode}, start-up cost {cost:.0f} s, {'vanish' if hosts else 'chain'} #{repeat + 1} ...")
    try:
        run = elastic.run_local(runner, _bench_settings(s, mode), name, 2, 3, chaos, train, backend, hosts=hosts)
    except BenchError as e:  # one failed run is a result (counted, its tail kept), not the end of the bench
        log(f"  failed: {str(e).splitlines()[0][-300:]}")
        return {"mode": mode, "startup_cost_s": cost, "repeat": repeat, "hosts": hosts, "chaos": chaos,
                "events": [], "error": str(e)[-3000:]}
    events = [_event(e) for e in run["report"]["events"] if e["kind"] in (*EVENTS, "cont")]
    for e in events:
        log(f"  {e['kind']}: stall {sec(e['stall_s'])}, recovery {sec(e['recovery_s'])}, redone "
            f"{e['steps_redone']}, {e['breakdown']}")
    return {"mode": mode, "startup_cost_s": cost, "repeat": repeat, "hosts": hosts, "chaos": chaos, "events": events,
            "orphans": run["report"].get("orphans"), **{k: run[k] for k in ("exit_code", "wall_s", "load_avg",
                                                                              "command")}}


def _bench_settings(s: InPlaceSettings, mode: str):
    from bench.settings import Settings

    return Settings(mode="in-place", data_dir=s.data_dir, repeats=s.repeats, steps=0,
                    global_batch_size=s.global_batch_size,
                    timeout_s=s.c10d_timeout_s if mode == "c10d" else s.timeout_s)


def _event(e: dict) -> dict:
    keep = ("kind", "node", "at_step", "world_size_before", "world_size_after", "recovery_s", "stall_s",
            "steps_redone", "breakdown")
    return {k: e.get(k) for k in keep}


def measure_recovery(runner: Runner, s: InPlaceSettings) -> list[dict]:
    """Every mode and cost, the repeats interleaved (the mode order rotates) so that no mode always runs on a
    quieter machine."""
    runs, modes = [], list(MODES)
    for repeat in range(s.repeats):
        for cost in s.costs:
            order = modes[repeat % 3:] + modes[:repeat % 3]
            for mode in order:
                if mode != "c10d" or repeat < s.c10d_repeats:
                    runs.append(_run(runner, s, mode, cost, repeat, hosts=False))
            for mode in (m for m in order if m != "c10d" and os.geteuid() == 0):
                runs.append(_run(runner, s, mode, cost, repeat, hosts=True))
    return runs


def summarize(runs: list[dict]) -> list[dict]:
    """Per (event, cost, mode): stall and recovery as median (min-max), the most steps redone, the breakdown."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        for e in run["events"]:
            groups.setdefault((e["kind"], run["startup_cost_s"], run["mode"]), []).append(e)
    out = []
    for (kind, cost, mode), es in sorted(groups.items()):
        parts = {p: median([(e["breakdown"] or {}).get(p) for e in es]) for p in elastic.BREAKDOWN}
        out.append({"kind": kind, "startup_cost_s": cost, "mode": mode, "n": len(es),
                    "stall_s": spread([e["stall_s"] for e in es]), "recovery_s": spread([e["recovery_s"] for e in es]),
                    "steps_redone_max": max((e["steps_redone"] for e in es if e["steps_redone"] is not None),
                                            default=None),
                    "in_place": all((e["breakdown"] or {}).get("in_place") for e in es), "breakdown": parts})
    return out


def storm_trace(work: Path, s: InPlaceSettings) -> Path:
    """2, 1, 2, 1, ... nodes, one count per storm tick: a kill or a join every tick."""
    path = work / "storm-trace.json"
    counts = [2 - (i % 2) for i in range(s.storm_intervals + 1)]
    path.write_text(json.dumps({"metadata": {"gap_seconds": s.storm_tick_s}, "data": counts}))
    return path


def measure_storm(runner: Runner, s: InPlaceSettings) -> list[dict]:
    from bench.runner import python_m, shown

    trace = storm_trace(runner.work_dir, s)
    out = []
    for mode, (backend, conf) in MODES.items():
        run_dir = runner.new_dir(f"storm-{mode}")
        cmd = python_m("elastic_mnist") + [
            "local", "--trace", str(trace), "--tick", str(s.storm_tick_s), "--notice", "0", "--max-nodes", "2",
            "--rdzv-backend", backend, *(["--rdzv-conf", conf] if conf else []), "--run-dir", str(run_dir / "run"),
            "--timeout", str(int(s.storm_intervals * s.storm_tick_s + 150)), "--data-dir", s.data_dir,
            "--epochs", "10", "--min-step-time", "0.3", "--startup-cost", "8"]
        log(f"storm: {mode}, a change every {s.storm_tick_s:.0f} s for {s.storm_intervals} ticks ...")
        rc, wall, load = runner.run(cmd, run_dir / "launcher.log", s.storm_intervals * s.storm_tick_s + 400)
        path = run_dir / "run" / "report.json"
        if not path.exists():  # a result too: said, kept, and the other modes still run
            log(f"  {mode}: failed, {shown(cmd)} exited {rc} without report.json")
            out.append({"mode": mode, "ettr": None, "error": f"exited {rc} without report.json", "exit_code": rc,
                        "command": shown(cmd)})
            continue
        g = json.loads(path.read_text())["goodput"]
        out.append({"mode": mode, "ettr": g["ettr"], "goodput": g["goodput"], "parts_s": g["parts_s"],
                    "exit_code": rc, "wall_s": round(wall, 1), "load_avg": load, "command": shown(cmd)})
        log(f"  {mode}: ETTR {pct(g['ettr'])}, goodput {pct(g['goodput'])}, parts {g['parts_s']}")
    return out


def measure(runner: Runner, s: InPlaceSettings) -> dict:
    from bench.frozen import measure_frozen_plain
    from bench.spot import warm_data_cache

    warm_data_cache(s.data_dir)
    runs = measure_recovery(runner, s)
    result = {"settings": asdict(s), "runs": runs, "summary": summarize(runs), "storm": measure_storm(runner, s),
              "frozen_plain": measure_frozen_plain(runner, s.data_dir, s.repeats)}
    result["targets"] = judge(result)
    return result


def _stall(result: dict, kind: str, cost: float, mode: str = "in-place") -> float | None:
    row = next((r for r in result["summary"] if (r["kind"], r["startup_cost_s"], r["mode"]) == (kind, cost, mode)),
               None)
    return None if row is None else row["stall_s"]["median"]


def judge(result: dict) -> list[dict]:
    from bench.targets import target

    storm = {r["mode"]: r["ettr"] for r in result["storm"]}
    frozen = result["frozen_plain"]["stall_s"]["median"]
    return [
        target("kill_0", "kill, no start-up cost: stall <= 0.5 s", _stall(result, "kill", 0.0), "<=", 0.5),
        target("kill_8", "kill, --startup-cost 8: stall <= 1.0 s", _stall(result, "kill", 8.0), "<=", 1.0),
        target("term_0", "preemption, no start-up cost: stall <= 0.4 s", _stall(result, "term", 0.0), "<=", 0.4),
        target("term_8", "preemption, --startup-cost 8: stall <= 0.4 s", _stall(result, "term", 8.0), "<=", 0.4),
        target("join_0", "join, no start-up cost: running nodes' stall <= 0.5 s", _stall(result, "join", 0.0), "<=",
               0.5),
        target("join_8", "join, --startup-cost 8: running nodes' stall <= 1.0 s", _stall(result, "join", 8.0), "<=",
               1.0),
        target("frozen_plain", "frozen node, plain torchrun + last_call_timeout=2: <= 3 s", frozen, "<=", 3.0),
        target("storm", "storm (every 15 s, --startup-cost 8): ETTR >= 90%", storm.get("in-place"), ">=", 0.9,
               f"fresh {pct(storm.get('fresh'))}, c10d {pct(storm.get('c10d'))}")]


def render(result: dict) -> str:
    lines = ["| change | start-up cost | mode | n | stall p50 (min-max) | recovery p50 | redone (max) | in place | "
             "detect / rendezvous / attach / group / state / first step (p50) |", "|" + "---|" * 9]
    for r in result["summary"]:
        if r["kind"] == "cont":
            continue
        st, rc, b = r["stall_s"], r["recovery_s"], r["breakdown"]
        parts = " / ".join(sec(b.get(p)).replace(" s", "") for p in elastic.BREAKDOWN)
        lines.append(f"| {LABELS.get(r['kind'], r['kind'])} | {r['startup_cost_s']:.0f} s | {r['mode']} | {r['n']} | "
                     f"{sec(st['median'])} ({sec(st['min'])}-{sec(st['max'])}) | {sec(rc['median'])} | "
                     f"{r['steps_redone_max']} | {'yes' if r['in_place'] else 'no'} | {parts} s |")
    lines += ["", "| storm mode | ETTR | goodput | productive s | redone s | detection s | rendezvous s | "
              "worker start s | resume s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["storm"]:
        if r.get("error"):
            lines.append(f"| {r['mode']} | failed: {r['error']} |" + " |" * 7)
            continue
        p = r["parts_s"]
        lines.append(f"| {r['mode']} | {pct(r['ettr'])} | {pct(r['goodput'])} | " + " | ".join(
            f"{p.get(k, 0):.1f}" for k in ("productive", "redone", "detection", "rendezvous", "worker_start",
                                           "resume")) + " |")
    lines += [f"\n{r['mode']} storm: {r['note']}" for r in result["storm"] if r.get("note")]
    lines += [f"\n{note}" for note in result.get("notes", [])]  # rows merged from another run say so here
    failed = [r for r in result["runs"] if r.get("error")]
    lines += ["", f"Runs that failed (no report; each kept in inplace.json): {len(failed)}" + "".join(
        f"; {r['mode']}, start-up cost {r['startup_cost_s']:.0f} s, {'vanish' if r['hosts'] else 'chain'}"
        for r in failed) + "."] if failed else []
    fp = result["frozen_plain"]
    lines += ["", f"Frozen node under plain torchrun (the README's etcd-v3 command plus `--rdzv-conf "
              f"last_call_timeout=2`, every process of node 1 SIGSTOPped): stall p50 {sec(fp['stall_s']['median'])} "
              f"({sec(fp['stall_s']['min'])}-{sec(fp['stall_s']['max'])}, n={fp['stall_s']['n']}).", ""]
    lines += [f"- {t['description']}: {'met' if t['met'] else 'MISSED' if t['met'] is False else 'not measured'} "
              f"({t['value']}){'; ' + t['detail'] if t['detail'] else ''}" for t in result["targets"]]
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path, docs: Path | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "inplace.json").write_text(json.dumps(result, indent=1) + "\n")
    text = "<!-- generated by `python -m bench --in-place-only` from inplace.json; do not edit -->\n" + \
        f"Measured {result.get('finished_at', '')} on: {result.get('machine_line', '')}. Tree: " \
        f"{result.get('provenance', {}).get('describe', '')}.\n\n" + render(result)
    (out / "inplace.md").write_text(text)
    if docs is not None:
        report.update_between_markers(docs, text, START, END)
