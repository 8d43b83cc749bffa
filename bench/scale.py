"""What a change costs against the job's size: a kill of the first, a middle and the last node at 2, 3, 4, 6
and 8 nodes, and a preemption and a join at 8, one run each, etcd-v3, rounds in place.

    python -m bench --scale-only --data-dir ../shared/data --update-docs     # ~15 min on 2 cores

On one machine every node is an agent, a warm process and a worker on the same 2 cores, so the larger
sizes also measure that crowding. The stall is from the last step anyone trained before the change to the
first at the new size (chaos.account), with its breakdown and the CPU each role used meanwhile (ledger.py):
cores near 100% busy mean the stall is the crowding's, not a wait. Writes OUT/scale.json and OUT/scale.md;
--update-docs puts the table between `<!-- scale:start -->` and `<!-- scale:end -->` in docs/benchmarks.md.
"""

from __future__ import annotations

import os
from pathlib import Path

from bench import elastic, report, teardown
from bench.fmt import phase, sec
from bench.ledger import Ledger
from bench.runner import BenchError, Runner, log
from bench.settings import Settings

START, END = "<!-- scale:start -->", "<!-- scale:end -->"
SIZES = (2, 3, 4, 6, 8)
FAULT_STEP = 60


def cases() -> list[tuple[int, str, str]]:
    """(nodes, fault, which node): a kill of the first, a middle and the last at each size; at the largest a
    preemption of a middle node and a join."""
    out = []
    for n in SIZES:
        for node in sorted({0, n // 2, n - 1}):
            out.append((n, "kill", f"n{node}"))
    big = SIZES[-1]
    return out + [(big, "term", f"n{big // 2}"), (big, "join", "")]


def measure(runner: Runner, data_dir: str) -> dict:
    s = Settings(mode="scale", data_dir=data_dir, repeats=1, steps=0, global_batch_size=128, timeout_s=300.0)
    train = ["--max-steps", "100000", "--min-step-time", "0.05", "--collective-timeout", "20", "--end-after-chaos"]
    rows, closes = [], teardown.measure()
    log(f"scale: a SIGKILLed process's sockets close after {closes} ms (by MB resident)")
    for nodes, kind, node in cases():
        chaos = f"{kind}:{node}@step={FAULT_STEP}" if node else f"{kind}@step={FAULT_STEP}"
        max_nodes = nodes + 1 if kind == "join" else nodes
        log(f"scale: {nodes} nodes, {chaos} ...")
        try:
            with Ledger() as ledger:
                run = elastic.run_local(runner, s, f"scale-{nodes}-{kind}-{node or 'new'}", nodes, max_nodes, chaos,
                                        train)
        except BenchError as e:
            rows.append({"nodes": nodes, "kind": kind, "node": node, "error": str(e)[-2000:]})
            continue
        event = next((e for e in run["report"]["events"] if e["kind"] == kind), {})
        row = {"nodes": nodes, "kind": kind, "node": node or event.get("node"), "stall_s": event.get("stall_s"),
               "recovery_s": event.get("recovery_s"), "steps_redone": event.get("steps_redone"),
               "breakdown": event.get("breakdown"), "command": run["command"], **_cpu(ledger, event)}
        log(f"  stall {sec(row['stall_s'])}, redone {row['steps_redone']}, {row['breakdown']}")
        rows.append(row)
    return {"rows": rows, "teardown_ms": closes}


def _cpu(ledger: Ledger, event: dict) -> dict:
    """The CPU each role used while the job stalled (the last step before the change to the first after it),
    and how busy that kept the machine's cores."""
    if event.get("stall_s") is None or event.get("recovery_s") is None:
        return {}
    first = event["time"] + event["recovery_s"]
    used = ledger.window(first - event["stall_s"], first)
    cores = len(os.sched_getaffinity(0))  # the cores this run may use, not the machine's
    return {"cpu_s": used, "cpu_busy": round(sum(used.values()) / (cores * event["stall_s"]), 2),
            "ledger_cpu_s": round(ledger.own_cpu_s, 2)}


def _teardown_line(closes: dict | None) -> list[str]:
    if not closes:
        return []
    small, large = sorted(closes, key=int)[0], sorted(closes, key=int)[-1]
    return ["", f"A SIGKILLed process's connections end {closes[large]:.0f} ms after the signal with {large} MB "
            f"resident, {closes[small]:.0f} ms with {small} MB (bench/teardown.py): a killed worker's peers learn "
            "of it no sooner."]


def render(result: dict) -> str:
    lines = [report.measured(result), *_teardown_line(result.get("teardown_ms")), "",
             "| nodes | change | node | stall | detection | rendezvous | steps redone | cores busy | stand-ins' CPU "
             "| agents' CPU |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['nodes']} | {r['kind']} | {r['node']} | failed | | | | | | |")
            continue
        cpu = r.get("cpu_s") or {}
        busy = f"{r['cpu_busy']:.0%}" if r.get("cpu_busy") is not None else ""
        lines.append(f"| {r['nodes']} | {r['kind']} | {r['node']} | {sec(r['stall_s'])} | {phase(r, 'detection_s')} | "
                     f"{phase(r, 'rendezvous_s')} | {r['steps_redone']} | {busy} | {sec(cpu.get('stand-in'))} | "
                     f"{sec(cpu.get('agent'))} |")
    head = "<!-- generated by `python -m bench --scale-only` from scale.json; do not edit -->\n"
    return head + "\n".join(lines) + "\n"


def write(result: dict, out: Path, docs: Path | None) -> bool:
    return report.write_section("scale", result, render(result), out, docs, START, END)
