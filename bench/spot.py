"""Goodput on a real spot market: one trace window (or the whole trace) replayed, on the same tick and
workload profile, by this runtime (etcd-v3, defaults), the same worker under torchrun's c10d backend (torch's
defaults) and a checkpoint-restart loop; then the runtime's final model against the uninterrupted run's at the
same step, and (whole trace) how much its kept workers grew over the rounds they served.

    python -m bench --spot-only --data-dir ../shared/data --update-docs     # one window, ~20 min on 2 cores
    python -m bench --spot-only --spot-whole --data-dir ../shared/data --update-docs   # all of it, ~70 min
    python -m elastic_mnist local --trace TRACE --trace-window 2136:100 --tick 3.5 ...   # what runs here

Writes OUT/spot.json, OUT/spot.md and OUT/spot.png (OUT/spot-whole.* for the whole trace); --update-docs puts
the table between `<!-- spot:start -->` and `<!-- spot:end -->` (`spot-whole:`) in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import report
from bench.fmt import num, pct
from bench.runner import REPO, BenchError, Runner, log, python_m, shown

TRACE = REPO.parent / "shared" / "spot-traces" / "aws-us-east-1f-v100-4node-2023-08.json"
# (name, label, launcher flags, train flags). The restart loop has no in-memory snapshots: a plain
# script restarts from what its periodic checkpoints saved.
SYSTEMS = (("elastic", "this runtime (etcd-v3, defaults)", [], []),
           ("c10d", "torchrun c10d (torch's defaults)", ["--rdzv-backend", "c10d"], []),
           ("restart", "checkpoint-restart loop", ["--on-change", "restart-all"], ["--snapshot-every", "0"]))


WHOLE_TICK_S = 0.35
"""The whole trace's tick: 3,664 intervals in 21 minutes a system (a change every 5 s on average)."""


@dataclass
class SpotSettings:
    data_dir: str
    trace: str = str(TRACE)
    window: str = "2136:100"
    """100 intervals (8.3 h of the market): a ramp 1->4, a drop 3->0 for 16 intervals, back to 4, 4->2->4.
    Empty: the whole trace (then the epochs are enough to train through all of it)."""
    tick_s: float = 3.5
    """100 ticks of 3.5 s: the three systems together take about 20 minutes."""
    notice_s: float = 30.0
    seed: int = 0
    min_step_time: float = 0.3
    """A GPU job's step, not a 4 ms MNIST step: what a change interrupts weighs as it would there."""
    startup_cost: float = 8.0
    """CUDA context, NCCL init and model load of a real job at every worker start."""
    epochs: int = 10
    """More than the window trains: every system trains through the whole window."""
    global_batch_size: int = 128


    @property
    def name(self) -> str:
        """The files' and the docs markers' name: spot (a window) or spot-whole."""
        return _name(asdict(self))

    def ticks(self) -> int:
        if self.window:
            return int(self.window.split(":")[1])
        return len(json.loads(Path(self.trace).read_text())["data"])

    def for_whole_trace(self) -> SpotSettings:
        """The settings with epochs enough for every tick of the whole trace at full speed (one more, spare)."""
        steps = self.ticks() * self.tick_s / self.min_step_time
        return SpotSettings(**{**asdict(self), "epochs": math.ceil(steps * self.global_batch_size / 60000) + 1})


def _run(runner: Runner, sp: SpotSettings, name: str, flags: list[str], train: list[str]) -> dict:
    run_dir = runner.new_dir(f"{sp.name}-{name}")
    ticks = sp.ticks()
    window = ["--trace-window", sp.window] if sp.window else []
    cmd = python_m("elastic_mnist") + [
        "local", "--trace", sp.trace, *window, "--tick", str(sp.tick_s),
        "--notice", str(sp.notice_s), "--trace-seed", str(sp.seed), "--max-nodes", "4", *flags,
        "--run-dir", str(run_dir / "run"), "--timeout", str(int(ticks * sp.tick_s + 120)),
        "--data-dir", sp.data_dir, "--global-batch-size", str(sp.global_batch_size), "--epochs", str(sp.epochs),
        "--min-step-time", str(sp.min_step_time), "--startup-cost", str(sp.startup_cost), *train]
    log(f"spot: {name} ({' '.join(flags) or 'defaults'}) over {ticks} ticks of {sp.tick_s} s ...")
    rc, wall, load = runner.run(cmd, run_dir / "launcher.log", ticks * sp.tick_s + 300)
    report_path = run_dir / "run" / "report.json"
    if not report_path.exists():
        text = (run_dir / "launcher.log").read_text(errors="replace")
        raise BenchError(f"{shown(cmd)} exited {rc} without report.json:\n{text[-3000:]}")
    rep = json.loads(report_path.read_text())
    g = rep["goodput"]
    rec = {"system": name, "exit_code": rc, "wall_s": round(wall, 1), "load_avg": load, "command": shown(cmd),
           "run_dir": str(run_dir / "run"), "goodput": g, "orphans": rep["orphans"],
           "steps_done": len({s["step"] for s in _samples(run_dir / "run")}),
           "agent_restarts": sum(1 for e in rep["events"] if e["kind"] == "agent-restart"),
           "store_hosts": _store_hosts(run_dir / "run") if name == "c10d" else None,
           "window_done": rep.get("trace", {}).get("window_done"), "changes": len(g["events"]),
           "kept": kept_growth(run_dir / "run") if name == "elastic" and not sp.window else None}
    log(f"  {name}: ETTR {g['ettr']} (compressed), goodput {g['goodput']}, real-scale ETTR "
        f"{g['real_scale']['ettr']} ({g['real_scale']['ettr_without_startup_cost']} without start-up cost), "
        f"{rec['steps_done']} steps, parts {g['parts_s']}")
    return rec


def _samples(run_dir: Path) -> list[dict]:
    from elastic_mnist.runlog import read_records

    return read_records(str(run_dir / "samples"))


KEPT_MIN_ROUNDS = 30  # the soak's warm-up (20 rounds) and the ten its measures need after it


def kept_growth(run_dir: Path) -> dict:
    """Every kept worker that served enough rounds to judge (the soak's warm-up and ten more): its RSS slope
    per 100 rounds and its thread, descriptor and socket growth (bench/soak.py's measures); the worst of each."""
    from bench import soak
    from elastic_mnist.runlog import read_records

    ends = [r for r in read_records(str(run_dir / "tensorboard" / "events")) if r.get("event") == "round_end"]
    by_pid: dict = {}
    for r in sorted(ends, key=lambda r: r.get("time", 0.0)):
        by_pid.setdefault((r.get("node"), r.get("pid")), []).append(soak._round_row(r))
    workers = {f"{node}/{pid}": rows for (node, pid), rows in by_pid.items() if len(rows) >= KEPT_MIN_ROUNDS}
    out = {"workers": {}, "rounds_max": max((len(r) for r in by_pid.values()), default=0)}
    for who, rows in workers.items():
        out["workers"][who] = {"rounds": len(rows), "rss_mb_per_100": soak.rss_per_100(rows),
                               **{k: soak.growth(rows, k).get("growth") for k in ("threads", "fds", "sockets")}}
    for key in ("rss_mb_per_100", "threads", "fds", "sockets"):
        values = [w[key] for w in out["workers"].values() if w[key] is not None]
        out[f"worst_{key}"] = max(values) if values else None
    return out


def _store_hosts(run_dir: Path) -> list[str]:
    """The c10d nodes whose agent hosted the rendezvous store (torch logs it at INFO)."""
    return sorted(p.stem for p in (run_dir / "nodes").glob("*.log")
                  if "hosts the TCP store" in p.read_text(errors="replace"))


def plan_replayed(run_dir: Path, batch: int, seed: int = 0) -> dict:
    """Every sample record used its rank's share of the planned global batch, and the steps done are
    0..N-1 without a gap: the uninterrupted order across the whole trace."""
    from elastic_mnist.data.mnist import BatchPlan

    plan = BatchPlan(60000, batch, seed)
    recs = _samples(run_dir)
    bad = sum(1 for r in recs if r["indices"] != plan.rank_indices(r["step"], r["world_size"], r["rank"]).tolist())
    steps = {r["step"] for r in recs}
    return {"records": len(recs), "mismatched": bad, "steps": len(steps),
            "contiguous": steps == set(range(len(steps))), "ok": bad == 0 and steps == set(range(len(steps)))}


def accuracy(runner: Runner, sp: SpotSettings, run_dir: Path) -> dict:
    """The runtime's newest checkpoint of the replay, evaluated, against an uninterrupted (unpaced,
    world 1) run to the same step."""
    ckpts = sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))
    if not ckpts:
        return {"skipped": "no checkpoint"}
    step = int(re.findall(r"\d+", ckpts[-1].stem)[-1])
    out = {"step": step}
    for name in ("replay", "uninterrupted"):
        d = runner.new_dir(f"spot-accuracy-{name}")
        if name == "replay":
            shutil.copytree(run_dir / "checkpoints", d / "ckpt")
        cmd = python_m("elastic_mnist.train") + [
            "--data-dir", sp.data_dir, "--global-batch-size", str(sp.global_batch_size), "--epochs",
            str(sp.epochs), "--max-steps", str(step), "--checkpoint-dir", str(d / "ckpt"), "--log-dir",
            str(d / "logs"), "--snapshot-dir=", "--checkpoint-every", "0"]
        rc, _, _ = runner.run(cmd, d / "output.log", 900)
        summary = d / "logs" / "summary.json"
        if rc or not summary.exists():
            raise BenchError(f"{shown(cmd)} exited {rc}:\n{(d / 'output.log').read_text(errors='replace')[-2000:]}")
        out[name] = json.loads(summary.read_text())["test_accuracy"]
        out[f"{name}_command"] = shown(cmd)
    out["difference_pp"] = round(100 * (out["replay"] - out["uninterrupted"]), 3)
    return out


def warm_data_cache(data_dir: str) -> None:
    """Decode MNIST into its cache (data/cache.py) before the first system runs: else that system's first
    workers pay the decode (seconds, four at once) in its resume and the others do not."""
    from elastic_mnist.data.mnist import load_split

    load_split(data_dir, True), load_split(data_dir, False)


def measure(runner: Runner, sp: SpotSettings) -> dict:
    sp = sp if sp.window else sp.for_whole_trace()
    warm_data_cache(sp.data_dir)
    systems = [_run(runner, sp, name, flags, train) for name, _, flags, train in SYSTEMS]
    ours = Path(systems[0]["run_dir"])
    result = {"settings": asdict(sp), "systems": systems, "plan": plan_replayed(ours, sp.global_batch_size),
              "accuracy": accuracy(runner, sp, ours)}
    result["targets"] = judge(result)
    return result


def judge(result: dict) -> list[dict]:
    from bench.targets import target

    by = {s["system"]: s["goodput"] for s in result["systems"]}
    ours, others = by["elastic"], [v for k, v in by.items() if k != "elastic"]
    rs, whole = ours["real_scale"], not result["settings"]["window"]
    better = [all((ours[key] or 0) > (o[key] or 0) for o in others) for key in ("ettr", "goodput")] + [
        all((rs["ettr"] or 0) > (o["real_scale"]["ettr"] or 0) for o in others)]
    out = [target("spot_real_ettr", "real-scale ETTR >= 99% (bench profile)", rs["ettr"], ">=", 0.99, rs["label"]),
            target("spot_real_ettr_plain", "real-scale ETTR >= 99.7% without the start-up cost",
                   rs["ettr_without_startup_cost"], ">=", 0.997, rs["label"]),
            target("spot_better", "better than c10d and the restart loop on every row (ETTR, goodput, real-scale)",
                   float(all(better)), ">=", 1.0, f"ETTR / goodput / real-scale ETTR better: {better}")]
    if whole:
        mine = result["systems"][0]
        out += [target("spot_whole_ettr", "whole trace: real-scale ETTR >= 99.8%", rs["ettr"], ">=", 0.998,
                       rs["label"]),
                target("spot_whole_survived", "whole trace: the run ended with the trace, exit 0",
                       float(mine["exit_code"] == 0 and bool(mine["window_done"])), ">=", 1.0,
                       f"exit {mine['exit_code']}, trace over: {mine['window_done']}, {mine['changes']} changes")]
    return out


PART_NAMES = ("productive", "redone", "detection", "rendezvous", "worker_start", "resume", "no_node")


def render(result: dict, image_prefix: str = "") -> str:
    sp, labels = result["settings"], {n: label for n, label, _, _ in SYSTEMS}
    head = ["system", "exit", "steps", "ETTR (replay)", "goodput (replay)", "ETTR real scale*",
            "* without start-up cost", *[f"{p} s" for p in PART_NAMES]]
    rows = []
    for s in result["systems"]:
        g, rs = s["goodput"], s["goodput"]["real_scale"]
        rows.append([labels[s["system"]], str(s["exit_code"]), str(s["steps_done"]), pct(g["ettr"]),
                     pct(g["goodput"]), pct(rs["ettr"]), pct(rs["ettr_without_startup_cost"]),
                     *[num(g["parts_s"][p], ".1f") for p in PART_NAMES]])
    acc, plan = result["accuracy"], result["plan"]
    what = f"Window {sp['window']}" if sp["window"] else f"The whole trace ({result['systems'][0]['changes']} changes)"
    lines = [f"{what} of `{Path(sp['trace']).name}`, one interval per {sp['tick_s']} s, "
             f"{sp['notice_s']:.0f} s notice, steps of {sp['min_step_time']} s, {sp['startup_cost']:.0f} s start-up "
             f"cost per worker start, global batch 128, {sp['epochs']} epochs.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "\\* extrapolated to the trace's real time scale: each change's measured cost against the real "
              "300 s intervals (a change the next one cut short gets the median cost of its kind's whole ones).", ""]
    if "step" in acc:
        lines.append(f"Final model of this runtime at step {acc['step']}: test accuracy {acc['replay']:.4f} against "
                     f"{acc['uninterrupted']:.4f} uninterrupted ({acc['difference_pp']:+.3f} pp); sample logs "
                     f"{'replay the plan' if plan['ok'] else 'DO NOT replay the plan'} ({plan['records']} records, "
                     f"{plan['mismatched']} mismatched, steps 0..{plan['steps'] - 1}).")
    c10d = next(s for s in result["systems"] if s["system"] == "c10d")
    lines += ["", f"c10d store hosts over the run: {', '.join(c10d['store_hosts'] or []) or 'none logged'}; "
              f"agent restarts by the launcher: {c10d['agent_restarts']}.", ""]
    kept = result["systems"][0].get("kept")
    if kept and kept["workers"]:
        lines += [f"Kept workers of this runtime that served at least {KEPT_MIN_ROUNDS} rounds: "
                  f"{len(kept['workers'])} (the longest-lived {kept['rounds_max']} rounds); the worst of them grew "
                  f"{kept['worst_rss_mb_per_100']} MB RSS per 100 rounds, {kept['worst_threads']} threads, "
                  f"{kept['worst_fds']} fds and {kept['worst_sockets']} sockets (bench/soak.py's measures, from "
                  "round 20 on).", ""]
    elif kept:
        lines += [f"No kept worker served {KEPT_MIN_ROUNDS} rounds (the longest-lived served {kept['rounds_max']}): "
                  "compressed this far, the trace preempts every node within seconds, so growth over hundreds of "
                  "rounds is measured by the soak, not here.", ""]
    for t in result["targets"]:
        lines.append(f"- {t['description']}: {'met' if t['met'] else 'MISSED'} ({t['value']}); {t['detail']}")
    return "\n".join(lines + ["", f"![spot replay]({image_prefix}{_name(sp)}.png)", ""])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {n: label for n, label, _, _ in SYSTEMS}
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    series0 = result["systems"][0]["goodput"]["series"]
    a.step([p["t_s"] for p in series0], [p["nodes"] for p in series0], where="pre", color="k")
    a.set_ylabel("nodes (trace)")
    for s in result["systems"]:
        pts = s["goodput"]["series"]
        b.step([p["t_s"] for p in pts], [p["world_size"] for p in pts], where="pre", label=labels[s["system"]])
        c.plot([p["t_s"] for p in pts], [p["useful_samples"] for p in pts], label=labels[s["system"]])
    b.set_ylabel("world size")
    c.set_ylabel("useful samples (cumulative)")
    c.set_xlabel("replay seconds")
    c.legend()
    a.set_title("Spot trace replay: nodes, world size, useful samples")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _name(settings: dict) -> str:
    return "spot" if settings["window"] else "spot-whole"


def write(result: dict, out: Path, docs: Path | None) -> None:
    name = _name(result["settings"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(render(result))
    plot(result, out / f"{name}.png")
    if docs is not None:
        import os

        report.update_between_markers(docs, render(result, image_prefix=os.path.relpath(out, docs.parent) + "/"),
                                      f"<!-- {name}:start -->", f"<!-- {name}:end -->")
