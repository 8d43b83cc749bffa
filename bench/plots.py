"""PNG plots drawn from results.json alone (so they can be redrawn without re-measuring).

    python -c "import json, bench.plots as p; p.draw_all(json.load(open('bench/results/results.json')), '/tmp')"
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on build machines
import matplotlib.pyplot as plt

from bench.elastic import BREAKDOWN

IMPLS = (("ours", "ours (elastic trainer)"), ("seed", "seed loop"), ("bare", "bare loop (ceiling)"))
COLORS = {"detection_s": "#d62728", "rendezvous_s": "#ff7f0e", "attach_s": "#9467bd", "process_group_s": "#8c564b",
          "state_s": "#1f77b4", "first_step_s": "#2ca02c"}


def throughput_plot(results: dict, path: Path) -> None:
    summary = results["throughput"]["summary"]
    worlds = sorted(summary, key=int)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for i, (key, label) in enumerate(IMPLS):
        xs, ys, lo, hi = [], [], [], []
        for j, world in enumerate(worlds):
            cell = summary[world].get(key) or {}
            if cell.get("median") is None or (key == "bare" and world != "1"):
                continue  # bare runs once, as one process; it is drawn at world 1 only
            xs.append(j + (i - 1) * width)
            ys.append(cell["median"])
            lo.append(cell["median"] - cell["min"])
            hi.append(cell["max"] - cell["median"])
        ax.bar(xs, ys, width, label=label, yerr=[lo, hi], capsize=3)
    ax.set_xticks(range(len(worlds)), [f"world size {w}" for w in worlds])
    ax.set_ylabel("samples/s (median; bars: min-max)")
    ax.set_title("Training throughput, global batch 128")
    ax.legend()
    _save(fig, path)


def recovery_plot(results: dict, path: Path) -> None:
    rows = [(f"{run['scenario']}/{e['kind']}\n{run['backend']}", e, run["cold_start_s"])
            for run in results["recovery"]["runs"] for e in run["events"] if e["breakdown"]]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 2), 4.5))
    for i, (_, e, cold) in enumerate(rows):
        bottom = 0.0
        for key in BREAKDOWN:
            value = max(e["breakdown"].get(key) or 0.0, 0.0)
            ax.bar(i, value, 0.6, bottom=bottom, color=COLORS[key], label=key[:-2] if i == 0 else None)
            bottom += value
        if cold:
            ax.plot([i - 0.35, i + 0.35], [cold, cold], "k--", label="cold start" if i == 0 else None)
    ax.set_xticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set_xlim(-0.8, max(len(rows), 2) - 0.2)  # a lone bar keeps a sane width
    ax.set_ylabel("seconds from fault to first step")
    ax.set_title("Recovery breakdown (dashed: cold start of the same job)")
    ax.legend(fontsize=8)
    _save(fig, path)


def curve_plot(results: dict, path: Path) -> None:
    tta = results.get("time_to_accuracy") or {}
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in tta.get("runs", []):
        pts = run["curve"]
        line, = ax.plot([p["t_s"] for p in pts], [p["test_accuracy"] for p in pts], "o-", label=run["name"])
        for e in run["events"]:
            ax.axvline(e["t_s"], color=line.get_color(), linestyle=":", alpha=0.8)
            ax.annotate(f"{e['kind']} {e['node'] or ''}", (e["t_s"], 0.0), xycoords=("data", "axes fraction"),
                        xytext=(2, 4), textcoords="offset points", fontsize=7, color=line.get_color())
    if tta.get("threshold"):
        ax.axhline(tta["threshold"], color="grey", linewidth=0.8)
    if not tta.get("runs"):
        ax.text(0.5, 0.5, f"not measured ({tta.get('skipped', 'no runs')})", ha="center", transform=ax.transAxes)
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("test accuracy (epoch ends)")
    ax.set_title("Training curve; dotted lines: membership changes")
    if tta.get("runs"):
        ax.legend(fontsize=8)
    _save(fig, path)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_all(results: dict, out_dir: str | Path) -> list[str]:
    out = Path(out_dir)
    plots = {"throughput.png": throughput_plot, "recovery.png": recovery_plot, "training_curve.png": curve_plot}
    for name, draw in plots.items():
        draw(results, out / name)
    return list(plots)
