"""The markdown table generated from results.json (targets included), and the docs update.

    python -c "import json, bench.report as r; print(r.render(json.load(open('bench/results/results.json'))))"
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench.elastic import BREAKDOWN
from bench.fmt import num, pct, sec, times
from bench.machine import one_line

START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _cell(c: dict | None, spec: str = ",.0f") -> str:
    if not c or c.get("median") is None:
        return "n/a"
    m = format(c["median"], spec)
    return f"{m} ({format(c['min'], spec)}-{format(c['max'], spec)})" if c["n"] > 1 else m


def throughput_md(results: dict) -> list[str]:
    t = results["throughput"]
    reps = max((r["repeat"] for r in t["runs"]), default=0) + 1
    rows = [[f"{w}", _cell(c["ours"]), _cell(c["seed"]), _cell(c["bare"]) if w == "1" else "(1 process)",
             times(c["ours_vs_seed"]), times(c["ours_vs_bare"]), times(c["median_step"]["ours_vs_seed"]),
             times(c["median_step"]["ours_vs_bare"])] for w, c in sorted(t["summary"].items())]
    loader = [[w, _cell(c["dataloader"]), _cell(c["ours"]), times(c["dataloader_vs_ours"])]
              for w, c in sorted(t["summary"].items()) if c.get("dataloader", {}).get("n")]
    return [f"### Throughput (samples/s, median (min-max) of {reps} interleaved runs, {t['steps']} measured steps)",
            ""] + _table(["world", "ours", "seed loop", "bare loop", "ours/seed", "ours/bare",
                          "ours/seed by median step", "ours/bare by median step"], rows) + (
        ["", "Our trainer's DataLoader input path (`--input dataloader --num-workers 2`) beside the in-memory default:",
         ""] + _table(["world", "dataloader", "in-memory", "dataloader/in-memory"], loader) if loader else [])


def overhead_md(results: dict) -> list[str]:
    ov = results["checkpoint_overhead"]
    rows = []
    for name, flags in ov["flags"].items():
        v = ov[name]
        snap = f"{v['snapshot_block_ms_p50']:.2f}" if "snapshot_block_ms_p50" in v else "-"
        rows.append([name, " ".join(flags), _cell(v["samples_per_s"]), f"{v['step_ms_median']:.2f}",
                     num(v["checkpoints_saved"], ".0f"), f"{v['checkpoint_block_ms_p50']:.2f}",
                     f"{v['checkpoint_block_ms_p95']:.2f}", f"{v['checkpoint_block_ms_max']:.2f}", snap])
    probe = [_probe_line(k, p) for k, p in ov.get("probe", {}).items()] + _saves_line(ov.get("saves"))
    return [f"### Checkpoint overhead (world 1, {ov['max_steps']} steps)", ""] + _table(
        ["variant", "flags", "samples/s", "median step ms", "saves", "block p50 ms", "block p95 ms",
         "block max ms", "snapshot block p50 ms"], rows) + [
        "", (f"Throughput cost of 'on' vs 'off': {pct(ov['throughput_cost'])} (median of paired runs "
            f"{pct(ov['throughput_cost_paired'])}; by median step {pct(ov['step_time_cost'])}; the saves' "
            f"blocking alone {pct(ov['blocking_cost'])}). Why {ov['max_steps']} steps: {ov['why_max_steps']}"),
        ""] + probe


def _saves_line(saves: dict | None) -> list[str]:
    if not saves:
        return []
    kinds = "; ".join(f"{k.replace('_', ' ')} n={v['n']} median {num(v['median_ms'], '.2f')} ms max "
                      f"{num(v['max_ms'], '.2f')} ms" for k, v in saves["by_kind"].items())
    over = ", ".join(f"{o['variant']} #{o['repeat']} step {o['step']} ({o['kind'].replace('_', ' ')}) "
                     f"{o['block_ms']:.2f} ms vs step {o['step_ms_median']:.2f} ms"
                     for o in saves["longer_than_a_step"])
    return [f"- every save of every run above, by kind (first = the run's first save; epoch end = right "
            f"after the evaluation): {kinds}. Longer than the run's median step: "
            f"{len(saves['longer_than_a_step'])} of {saves['saves']}" + (f" ({over})" if over else "")]


def _probe_line(name: str, p: dict) -> str:
    return (f"- probe `{name}` (one save's anatomy, in-process, `python -m bench.save_cost`): state "
            f"{p['state_bytes'] / 2**20:.1f} MiB; the save call blocks {p['save_call_ms']:.2f} ms (state copy "
            f"{p['snapshot_ms']:.2f} ms; {p['save_call_ms_behind_another_write']:.2f} ms right behind another "
            f"writer); background encode {p['encode_ms']:.2f} ms + write {p['write_ms']:.2f} ms; "
            f"{p['steps_overlapping_a_write']:.1f} steps overlap the write at "
            f"{num(p['step_ms_during_write'], '.2f')} ms vs {p['step_ms_alone']:.2f} ms alone; "
            f"{p['extra_ms_per_save']:.2f} ms extra per save = **{pct(p['cost_at_interval'])}** at every "
            f"{p['interval']} steps ({pct(p['cost_bound_no_idle_core'])} if no core is idle)")


# One column per part of a recovery, named after its key (detection_s: "detection s"), so they cannot drift.
_BREAKDOWN_HEADS = [k.removesuffix("_s").replace("_", " ") + " s" for k in BREAKDOWN]


def recovery_md(results: dict) -> list[str]:
    rows = []
    for run in results["recovery"]["runs"]:
        for e in run["events"]:
            b = e["breakdown"] or {}
            world = f"{e['world_size_before']}->{e['world_size_after']}"
            name = run["scenario"] + (f" #{run['repeat'] + 1}" if run.get("repeat") else "")
            rows.append([name, run["backend"], e["kind"], world, sec(e["recovery_s"]),
                         sec(run["cold_start_s"]), times(e["recovery_over_cold_start"]), str(e["steps_redone"])]
                        + [num(b.get(k), ".2f") for k in BREAKDOWN])
    return [*recovery_summary_md(results), "### Recovery, every run (fault -> first step at the new world size)",
            ""] + _table(["scenario", "backend", "event", "world", "recovery", "cold start", "recovery/cold",
                          "steps redone", *_BREAKDOWN_HEADS], rows)


def recovery_summary_md(results: dict) -> list[str]:
    summary = results["recovery"].get("summary") or []
    if not any(g["n"] > 1 for g in summary):
        return []
    rows = [[g["scenario"], g["backend"], g["kind"], g["world"], str(g["n"]),
             _cell({**g["recovery_s"], "n": g["n"]}, ".2f") + " s", num(g["steps_redone_max"], "d")]
            + [num(g["breakdown"].get(k), ".2f") for k in BREAKDOWN] for g in summary]
    return ["### Recovery, median (min-max) of the runs", ""] + _table(
        ["scenario", "backend", "event", "world", "runs", "recovery", "most steps redone", *_BREAKDOWN_HEADS],
        rows) + [""]


def tta_md(results: dict) -> list[str]:
    tta = results["time_to_accuracy"]
    if not tta.get("runs"):
        return ["### Time to accuracy", "", f"Not measured ({tta.get('skipped', 'no runs')})."]
    def events(r: dict) -> str:
        return ", ".join(f"{e['kind']} at {e['t_s']:.1f} s" for e in r["events"]) or "-"

    rows = [[r["name"], r["chaos"] or "-", sec(r["tta_s"]), num(r["reached_at_step"], "d"),
             sec(r["tta_s_by_threshold"].get("0.97")), num(r["best_accuracy"], ".4f"),
             num(r["final_accuracy"], ".4f"), events(r)] for r in tta["runs"]]
    return [f"### Time to {tta['threshold']:.0%} test accuracy ({tta['epochs']} epochs, real MNIST)", ""] + _table(
        ["run", "faults", f"time to {tta['threshold']:.0%}", "step", "time to 97%", "best accuracy", "final accuracy",
         "events"],
        rows) + ["", f"Clock: {tta['clock']}. Accuracy is evaluated at epoch ends only."]


def targets_md(results: dict) -> list[str]:
    rows = [[t["description"], "n/a" if t["value"] is None else f"{t['value']:.3g}", f"{t['op']} {t['threshold']:g}",
             {True: "met", False: "**missed**", None: "not measured"}[t["met"]], t["detail"]]
            for t in results["targets"]]
    return ["### Targets", ""] + _table(["target", "measured", "needed", "verdict", "detail"], rows)


def render(results: dict, image_prefix: str = "") -> str:
    gpu = results.get("gpu")
    gpu_line = (f"GPU ({gpu['device']}): ours with NCCL " + ", ".join(
        f"world {w} {_cell(c)} samples/s" for w, c in gpu["summary"].items())) if gpu else \
        "GPU: none on this machine (`torch.cuda.is_available()` is False); the GPU section was not run."
    parts = [(f"Measured {results['finished_at']} in {results['mode']} mode ({results['wall_s']:.0f} s) on: "
             f"{one_line(results['machine'])}. Tree: {results['provenance']['describe']}."), "",
             *targets_md(results), "", *throughput_md(results), "", *overhead_md(results), "",
             *recovery_md(results), "", *tta_md(results), "", gpu_line, ""]
    parts += [f"![{n}]({image_prefix}{n})" for n in results["plots"]]
    return "<!-- generated by `python -m bench` from results.json; do not edit -->\n" + "\n".join(parts) + "\n"


def update_between_markers(doc: Path, text: str, start: str = START, end: str = END) -> bool:
    """Replace what lies between the markers; False (the file untouched) when they are not both there."""
    content = doc.read_text()
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(content):
        return False
    doc.write_text(pattern.sub(lambda _: f"{start}\n{text}{end}", content, count=1))
    return True


def write_section(name: str, result: dict, text: str, out: Path, docs: Path | None, start: str, end: str) -> bool:
    """OUT/NAME.json and OUT/NAME.md of one bench section, and with `docs` its table between the markers there
    (False when the page has no markers)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(text)
    return docs is None or update_between_markers(docs, text, start, end)


def measured(result: dict) -> str:
    """A bench section's first line: when, how long, on what machine, which tree."""
    return (f"Measured {result['finished_at']} ({result['wall_s']:.0f} s) on: {one_line(result['machine'])}. "
            f"Tree: {result['provenance']['describe']}.")
