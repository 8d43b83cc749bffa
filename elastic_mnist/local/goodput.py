"""Goodput accounting of a trace replay (`elastic-mnist local --trace`): where the wall time went.

    python -c "import json; print(json.load(open('runs/local-X/report.json'))['goodput']['parts_s'])"

The job's clock is its rank-0 process (each step ends on every rank at once). Every second of the replay
is in exactly one part, in this order of precedence: no_node (the trace had no node), productive (a
step's first completion: from the end of the step before, or the process's resume, to its sample
record), redone (a later completion of a step already done: lost work), worker_start (process start,
imports and --startup-cost), resume (process group, data, checkpoint), detection (a change of the node
count until the old workers stopped), rendezvous (everything else with a node up: the agents agreeing
on the next group). ETTR = productive / time with >= 1 node. Goodput = samples of steps done / what the
available capacity could have trained at the per-world-size throughput this run measured.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from elastic_mnist.runlog import worker_round

PARTS = ("productive", "redone", "detection", "rendezvous", "worker_start", "resume", "no_node")


# -- intervals: sorted, disjoint [start, end) lists ------------------------------------------------------
def merge(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(x for x in iv if x[1] > x[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def intersect(x: list, y: list) -> list[tuple[float, float]]:
    x, y, out, i, j = merge(x), merge(y), [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        i, j = (i + 1, j) if x[i][1] < y[j][1] else (i, j + 1)
    return out


def subtract(x: list, y: list) -> list[tuple[float, float]]:
    out = []
    for a, b in merge(x):
        for c, d in intersect([(a, b)], y):
            out.append((a, c))
            a = d
        out.append((a, b))
    return merge(out)


def length(iv: list) -> float:
    return sum(b - a for a, b in merge(iv))


# -- the accounting --------------------------------------------------------------------------------------
@dataclass
class Run:
    timeline: list
    """(unix time, node count) at each applied trace interval."""
    end: float
    processes: dict
    """worker round -> sample records (runlog.RunTail.processes)."""
    journal: list
    events: list
    """Report events (dicts): preempt, join, restart-all."""
    batch: int
    per_node: int
    tick_s: float
    gap_s: float
    ticks: list
    """The node count of each trace interval replayed (the last one perhaps cut short by the job's end)."""


def available(run: Run) -> list[tuple[float, float]]:
    bounds = [t for t, _ in run.timeline[1:]] + [run.end]
    return merge([(t, e) for (t, c), e in zip(run.timeline, bounds) if c > 0])


def step_intervals(run: Run) -> tuple[list, list, dict]:
    """(productive, redone, per world size: durations of steady productive steps) from rank 0."""
    resumed = {worker_round(e): e["phases"]["resumed"] for e in run.journal if e["event"] == "startup"}
    steps = []  # (end, start, step, world, first of its round)
    for key, recs in run.processes.items():
        prev = resumed.get(key)
        for i, r in enumerate(x for x in recs if x["rank"] == 0):
            if prev is not None:
                steps.append((r["time"], prev, r["step"], r["world_size"], i == 0))
            prev = r["time"]
    seen, productive, redone, rates = set(), [], [], {}
    for end, start, step, world, first in sorted(steps):
        (redone if step in seen else productive).append((start, end))
        if step not in seen and not first:
            rates.setdefault(world, []).append(end - start)
        seen.add(step)
    return productive, redone, rates


def startup_intervals(run: Run) -> tuple[list, list]:
    """(worker start, resume) of every rank-0 round that reached its first step: a fresh process's start-up,
    or a kept worker's attach to its round's stand-in."""
    start, resume = [], []
    for e in run.journal:
        if e["event"] == "startup" and e["rank"] == 0:
            p = e["phases"]
            paid = p.get("startup_cost") or p.get("imports") or p["attached"]
            start.append((round_start(p), paid))
            resume.append((paid, p["resumed"]))
    return start, resume


def round_start(phases: dict) -> float:
    """When torchrun started the round's process: the worker itself, or the stand-in of a kept one."""
    return phases.get("process_start") or phases["stand_in"]


def detection_intervals(run: Run) -> list:
    """From each change to the first stop (or failed collective) of the old workers after it; none when
    a new worker starts first (no old worker was running: a start from no node)."""
    stops = sorted(e["time"] for e in run.journal if e["event"] in ("stop", "collective_failed"))
    starts = sorted(round_start(e["phases"]) for e in run.journal if e["event"] == "startup")
    out = []
    for e in run.events:
        stop = next((t for t in stops if t >= e["time"]), None)
        start = next((t for t in starts if t >= e["time"]), None)
        if stop is not None and (start is None or stop <= start):
            out.append((e["time"], stop))
    return out


def split(run: Run) -> dict[str, list]:
    """Each part as intervals; together they tile [first interval, end) exactly."""
    t0 = run.timeline[0][0] if run.timeline else run.end
    up = available(run)
    productive, redone, _ = step_intervals(run)
    parts = {"no_node": subtract([(t0, run.end)], up)}
    left = up
    start, resume = startup_intervals(run)
    for name, iv in (("productive", productive), ("redone", redone), ("worker_start", start),
                     ("resume", resume), ("detection", detection_intervals(run))):
        parts[name] = intersect(left, iv)
        left = subtract(left, iv)
    parts["rendezvous"] = left
    return parts


def throughput(run: Run) -> dict[int, float]:
    """Samples/s per world size: the median steady step (not a process's first) of this run."""
    _, _, durations = step_intervals(run)
    return {w: run.batch / sorted(d)[len(d) // 2] for w, d in durations.items() if d}


def capacity(run: Run, rates: dict[int, float]) -> float | None:
    """Samples the available nodes could have trained: each interval at its world size's measured rate
    (the nearest world size measured when this one never ran steadily)."""
    if not rates:
        return None
    total, bounds = 0.0, [t for t, _ in run.timeline[1:]] + [run.end]
    for (t, count), e in zip(run.timeline, bounds):
        if count:
            world = count * run.per_node
            total += rates[min(rates, key=lambda w: (abs(w - world), -w))] * (e - t)
    return total


def event_costs(run: Run, parts: dict[str, list]) -> list[dict]:
    """Per change of the node count (the events of one trace interval together): what it cost from
    then until the next change, part by part, and whether the job trained again before that."""
    changes: dict[float, list[dict]] = {}
    for e in run.events:
        changes.setdefault(e["time"], []).append(e)
    times = sorted(changes) + [run.end]
    out = []
    for t, nxt in zip(times, times[1:]):
        win = [(t, nxt)]
        by = {k: round(length(intersect(parts[k], win)), 3) for k in PARTS if k not in ("productive", "no_node")}
        after = next((c for when, c in reversed(run.timeline) if when <= t), 0)
        # Trained again by the window's end (its last second has a productive step): the cost is whole,
        # not cut short by the next change. A change to no node costs nothing here (all no_node).
        trained = length(intersect(parts["productive"], [(nxt - 1.0, nxt)])) > 0
        out.append({"kind": changes[t][0]["kind"], "nodes": [e["node"] for e in changes[t]], "t": t,
                    "nodes_after": after, "cost_s": round(sum(by.values()), 3), "parts_s": by,
                    "recovered": after == 0 or trained, "window_s": round(nxt - t, 3)})
    return out


def real_scale(run: Run, costs: list[dict], startup_cost_s: float) -> dict:
    """ETTR at the trace's own time scale: each change costs what it cost here, against the real
    intervals (gap_s each). A change the next one cut short before it recovered gets the median cost
    of the recovered changes of its kind (flagged); the start-up cost paid per worker start is also
    taken out for the second figure."""
    real_up = run.gap_s * sum(1 for c in run.ticks if c)
    done = {}
    for c in costs:
        if c["recovered"] and c["nodes_after"]:
            done.setdefault(c["kind"], []).append(c)
    lost = lost_plain = 0.0
    estimated = 0
    for c in costs:
        same = sorted(done.get(c["kind"], []), key=lambda x: x["cost_s"])
        pick = c if c["recovered"] or not same else same[len(same) // 2]
        estimated += pick is not c
        cost = min(pick["cost_s"], run.gap_s)
        lost += cost
        lost_plain += max(0.0, cost - startup_cost_s * pick.get("worker_starts", 0))
    if not real_up:
        return {"ettr": None, "ettr_without_startup_cost": None}
    return {"ettr": round(1 - lost / real_up, 5), "ettr_without_startup_cost": round(1 - lost_plain / real_up, 5),
            "real_available_s": real_up, "lost_s": round(lost, 3), "estimated_events": estimated,
            "label": "extrapolated: measured cost of each change against the trace's real interval lengths"}


def worker_starts(run: Run, costs: list[dict]) -> None:
    """How many rank-0 worker starts paid the start-up cost inside each change's window (a round served by a
    kept worker paid none: it built once, and a joiner before it joined)."""
    starts = [e["phases"]["process_start"] for e in run.journal if e["event"] == "startup" and e["rank"] == 0
              and "startup_cost" in e["phases"] and "process_start" in e["phases"]]
    for c in costs:
        c["worker_starts"] = sum(1 for s in starts if c["t"] <= s < c["t"] + c["window_s"])


def series(run: Run, parts: dict[str, list]) -> list[dict]:
    """Per trace interval: node count, rank 0's world size, useful samples so far, ETTR so far."""
    recs = sorted((r for rs in run.processes.values() for r in rs if r["rank"] == 0), key=lambda r: r["time"])
    t0 = run.timeline[0][0] if run.timeline else run.end
    out, seen, k, up = [], set(), 0, available(run)
    for i, count in enumerate(run.ticks):
        e, world = min(run.end, t0 + (i + 1) * run.tick_s), 0
        while k < len(recs) and recs[k]["time"] <= e:
            seen.add(recs[k]["step"])
            world, k = recs[k]["world_size"], k + 1
        avail = length(intersect(up, [(t0, e)]))
        prod = length(intersect(parts["productive"], [(t0, e)]))
        out.append({"t_s": round(e - t0, 3), "nodes": count, "world_size": world,
                    "useful_samples": len(seen) * run.batch, "ettr": round(prod / avail, 4) if avail else None})
    return out


def account(run: Run, startup_cost_s: float = 0.0) -> dict:
    parts = split(run)
    secs = {k: round(length(v), 3) for k, v in parts.items()}
    wall = run.end - run.timeline[0][0] if run.timeline else 0.0
    up = wall - secs["no_node"]
    rates = throughput(run)
    cap = capacity(run, rates)
    useful = len({r["step"] for rs in run.processes.values() for r in rs}) * run.batch
    costs = event_costs(run, parts)
    worker_starts(run, costs)
    return {"wall_s": round(wall, 3), "parts_s": secs, "parts_sum_s": round(sum(secs.values()), 3),
            "available_s": round(up, 3), "ettr": round(secs["productive"] / up, 4) if up > 0 else None,
            "useful_samples": useful, "capacity_samples": round(cap) if cap else None,
            "goodput": round(useful / cap, 4) if cap else None,
            "samples_per_s_by_world": {str(w): round(r, 1) for w, r in sorted(rates.items())},
            "events": costs, "real_scale": real_scale(run, costs, startup_cost_s), "series": series(run, parts)}


def summary_text(acc: dict) -> str:
    parts = ", ".join(f"{k} {v:.1f}s" for k, v in acc["parts_s"].items())
    rs = acc["real_scale"]
    return (f"goodput: wall {acc['wall_s']:.1f}s = {parts}\n"
            f"ETTR {acc['ettr']} (this compressed replay), goodput {acc['goodput']} of the available capacity; "
            f"ETTR at the trace's real time scale (extrapolated) {rs['ettr']}, "
            f"{rs['ettr_without_startup_cost']} without the start-up cost")


def write_tensorboard(log_dir: str, acc: dict) -> None:
    """ETTR, nodes, world size and useful samples per trace interval; the parts at the end."""
    from torch.utils.tensorboard import SummaryWriter  # only here: the launcher stays free of torch otherwise

    os.makedirs(log_dir, exist_ok=True)
    with SummaryWriter(log_dir=log_dir) as w:
        for i, s in enumerate(acc["series"]):
            for key in ("nodes", "world_size", "useful_samples", "ettr"):
                if s[key] is not None:
                    w.add_scalar(f"goodput/{key}", s[key], i)
        for k, v in acc["parts_s"].items():
            w.add_scalar(f"goodput/parts_s/{k}", v, len(acc["series"]))
        for key in ("ettr", "goodput"):
            if acc[key] is not None:
                w.add_scalar(f"goodput/final_{key}", acc[key], len(acc["series"]))
