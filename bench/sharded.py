"""Sharded training (--parallel fsdp) under chaos: what a kill, a join and a preemption cost a 37M-parameter
model resharded in memory, against a restart that loads a DCP checkpoint at the new size, and the seed's MLP
sharded; then the sharded run's throughput against DDP's on the same model. One run each, etcd-v3.

    python -m bench --sharded-only --data-dir ../shared/data --update-docs     # ~5 min on 2 cores

The stall is the launcher's (the last step trained before the change to the first at the new size), with its
breakdown: `state` is the agreement and the reshard, from the new round's group to the loaded state. The bytes
are what each rank sent in the reshard (its resume record). Writes OUT/sharded.json and OUT/sharded.md;
--update-docs puts the table between `<!-- sharded:start -->` and `<!-- sharded:end -->` in docs/benchmarks.md.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from bench import elastic, report
from bench.fmt import phase, sec
from bench.runner import BenchError, Runner, log, median, ratio
from bench.settings import Settings
from elastic_mnist.runlog import read_records

START, END = "<!-- sharded:start -->", "<!-- sharded:end -->"
LARGE = ("--hidden", "4096", "--hidden-layers", "3")  # 784-4096-4096-4096-10: 37M parameters, 421 MiB with Adam
FROM_FILES = ("--rdzv-conf", "in_place=0", "--checkpoint-every", "2")  # every change: new processes, DCP load
CASES = (  # (name, model, nodes, max nodes, chaos, extra flags)
    ("kill 3→2", LARGE, 3, 3, "kill:n2@step={at}", ()),
    ("kill 3→2, DCP restart", LARGE, 3, 3, "kill:n2@step={at}", FROM_FILES),
    ("join 2→3", LARGE, 2, 3, "join@step={at}", ()),
    ("preemption 3→2", LARGE, 3, 3, "term:n1@step={at}", ()),
    ("MLP kill 3→2", (), 3, 3, "kill:n2@step={at}", ()),
    ("MLP join 2→3", (), 2, 3, "join@step={at}", ()),
)


def measure(runner: Runner, data_dir: str) -> dict:
    s = Settings(mode="sharded", data_dir=data_dir, repeats=1, steps=0, global_batch_size=128, timeout_s=420.0)
    rows = []
    for name, model, nodes, max_nodes, chaos, extra in CASES:
        at = 6 if model else 60
        train = ["--parallel", "fsdp", *model, "--max-steps", "100000", "--collective-timeout", "30",
                 "--log-every", "2", "--end-after-chaos", *(() if model else ("--min-step-time", "0.05")), *extra]
        if "--checkpoint-every" not in extra:
            train += ["--checkpoint-every", "1000"]
        log(f"sharded: {name} ...")
        try:
            slug = "sharded-" + "".join(c if c.isascii() and c.isalnum() else "-" for c in name)
            run = elastic.run_local(runner, s, slug, nodes, max_nodes, chaos.format(at=at), train)
        except BenchError as e:
            rows.append({"case": name, "error": str(e)[-2000:]})
            continue
        rows.append(_row(name, run))
        log(f"  stall {sec(rows[-1]['stall_s'])}, redone {rows[-1]['steps_redone']}, {rows[-1]['breakdown']}")
    return {"rows": rows, "throughput": _throughput(runner, data_dir)}


def _row(name: str, run: dict) -> dict:
    kind = name.split()[-2] if name.startswith("MLP") else name.split()[0]
    kind = {"preemption": "term"}.get(kind, kind)
    event = next((e for e in run["report"]["events"] if e["kind"] == kind), {})
    argv = shlex.split(run["command"])
    run_dir = Path(argv[argv.index("--run-dir") + 1])
    records = read_records(str(run_dir / "tensorboard" / "events"))
    resumes = [r for r in records if r.get("event") == "resume" and r.get("time", 0) >= event.get("time", 0)]
    rates = [r["samples_per_s"] for r in records if r.get("event") == "progress" and r.get("samples_per_s")]
    return {"case": name, "stall_s": event.get("stall_s"), "steps_redone": event.get("steps_redone"),
            "breakdown": event.get("breakdown"), "step_ms": 1000 * 128 / median(rates) if rates else None,
            "sent_bytes": sorted(r.get("sent_bytes", 0) for r in resumes if "sent_bytes" in r),
            "sources": sorted({str(r.get("source")) for r in resumes}), "command": run["command"]}


def _throughput(runner: Runner, data_dir: str) -> dict:
    """The large model at world 2, 30 steps, replicated and sharded, one after the other."""
    out = {}
    for parallel in ("ddp", "fsdp"):
        log(f"sharded: throughput, {parallel} ...")
        args = ["--data-dir", data_dir, "--parallel", parallel, *LARGE, "--max-steps", "30", "--checkpoint-every",
                "0", "--snapshot-every", "0", "--log-every", "10"]
        try:
            summary = runner.trainer(2, args, f"throughput-{parallel}")
        except BenchError as e:
            out[parallel] = {"error": str(e)[-2000:]}
            continue
        out[parallel] = {"samples_per_s": summary["samples_per_s"], "step_ms": summary["step_ms_median"],
                         "command": summary["command"]}
    out["fsdp_over_ddp"] = ratio(out.get("fsdp", {}).get("samples_per_s"), out.get("ddp", {}).get("samples_per_s"))
    return out


def render(result: dict) -> str:
    lines = [report.measured(result), "",
             "| change | stall | detection | rendezvous | state (agreement + reshard) | first step | step | "
             "steps redone | bytes sent per rank | state from |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['case']} | failed | | | | | | | | |")
            continue
        sent = ", ".join(f"{b / 2**20:.1f} MiB" for b in r["sent_bytes"]) or "-"
        step = f"{r['step_ms'] / 1000:.2f} s" if r.get("step_ms") else ""
        lines.append(f"| {r['case']} | {sec(r['stall_s'])} | {phase(r, 'detection_s')} | {phase(r, 'rendezvous_s')} "
                     f"| {phase(r, 'state_s')} | {phase(r, 'first_step_s')} | {step} | {r['steps_redone']} | "
                     f"{sent} | {', '.join(os.path.basename(x) for x in r['sources'])} |")
    t = result["throughput"]
    if "error" not in t.get("ddp", {"error": 1}) and "error" not in t.get("fsdp", {"error": 1}):
        lines += ["", f"Throughput, 37M-parameter MLP at world 2: DDP {t['ddp']['samples_per_s']:.0f} samples/s, "
                  f"sharded {t['fsdp']['samples_per_s']:.0f} samples/s ({t['fsdp_over_ddp']:.2f}x)."]
    head = "<!-- generated by `python -m bench --sharded-only` from sharded.json; do not edit -->\n"
    return head + "\n".join(lines) + "\n"


def write(result: dict, out: Path, docs: Path | None) -> bool:
    return report.write_section("sharded", result, render(result), out, docs, START, END)
