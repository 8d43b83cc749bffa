"""The suite's targets, judged from results.json, each with the measured detail that explains it.

    python -c "import json, bench.targets as t; print(t.judge(json.load(open('bench/results/results.json'))))"
"""

from __future__ import annotations

from bench.fmt import pct, sec, times


def target(tid: str, text: str, value, op: str, threshold: float, detail: str = "") -> dict:
    met = None if value is None else (value >= threshold if op == ">=" else value <= threshold)
    return {"id": tid, "description": text, "value": value, "op": op, "threshold": threshold, "met": met,
            "detail": detail}


def _throughput(results: dict) -> list[dict]:
    w1 = results["throughput"]["summary"].get("1", {})
    step = w1.get("median_step", {})
    return [target("ours_vs_seed_w1", "throughput at world 1 >= 1.8x the seed loop", w1.get("ours_vs_seed"), ">=",
                   1.8, f"by median step time: {times(step.get('ours_vs_seed'))}"),
            target("ours_vs_bare_w1", "throughput at world 1 >= 0.9x the bare loop", w1.get("ours_vs_bare"), ">=",
                   0.9, f"by median step time: {times(step.get('ours_vs_bare'))}")]


def _cost_detail(ov: dict) -> str:
    probes = "; ".join(f"probe: {k} saves cost {pct(p['cost_at_interval'])} at every {p['interval']} steps"
                       for k, p in ov.get("probe", {}).items())
    return (f"checkpoints without snapshots {pct(ov.get('throughput_cost_checkpoints_only'))}; paired median "
            f"{pct(ov['throughput_cost_paired'])}; median step {pct(ov['step_time_cost'])}; blocking alone "
            f"{pct(ov['blocking_cost'])}; {probes}")


def _block_detail(ov: dict) -> str:
    def ms(v: dict) -> str:
        return (f"p50 {v['checkpoint_block_ms_p50']:.2f}, p95 {v['checkpoint_block_ms_p95']:.2f}, max "
                f"{v['checkpoint_block_ms_max']:.2f} ms vs step {v['step_ms_median']:.2f} ms")

    only, saves = ov.get("checkpoints_only"), ov.get("saves", {})
    over = [f"{o['variant']} step {o['step']} ({o['kind']}) {o['block_ms']:.1f} ms"
            for o in saves.get("longer_than_a_step", [])]
    return (f"block {ms(ov['on'])}" + (f"; without snapshots {ms(only)}" if only else "")
            + f"; {len(over)} of {saves.get('saves', 0)} saves longer than a step"
            + (f": {', '.join(over)}" if over else ""))


def _overhead(results: dict) -> list[dict]:
    ov = results["checkpoint_overhead"]
    return [target("checkpoint_cost", "periodic checkpoints cost <= 3% throughput", ov["throughput_cost"], "<=",
                   0.03, _cost_detail(ov)),
            target("checkpoint_block", "no save blocks longer than one (median) step", ov["block_max_over_step"],
                   "<=", 1.0, _block_detail(ov))]


def _where_recovery_goes(e: dict) -> str:
    parts = sorted((e.get("breakdown") or {}).items(), key=lambda kv: -(kv[1] or 0))
    return "largest parts: " + ", ".join(f"{k[:-2]} {v:.2f} s" for k, v in parts[:3]) if parts else ""


def _recovery(results: dict) -> list[dict]:
    out = []
    for run in results["recovery"]["runs"]:
        first, backend = (run["events"] or [{}])[0], run["backend"]
        if run["scenario"] == "kill" and not run.get("repeat"):
            which = "default etcd-v3" if backend == "etcd-v3" else f"legacy {backend}, for comparison"
            detail = (f"{sec(first.get('recovery_s'))} vs cold start {sec(run['cold_start_s'])}; "
                      + _where_recovery_goes(first))
            out.append(target(f"kill_recovery_{backend}", f"kill recovery <= 1.5x cold start ({which})",
                              first.get("recovery_over_cold_start"), "<=", 1.5, detail))
            if backend == "etcd":
                out.append(_legacy_floor(first))
    for g in results["recovery"].get("summary") or []:  # every run counts: the most any run redid
        if g["scenario"] in ("term", "join") and g["kind"] == g["scenario"]:
            out.append(target(f"{g['scenario']}_{g['backend']}_redone",
                              f"{g['scenario']}: zero steps redone ({g['backend']})", g["steps_redone_max"], "<=", 0))
    return out


RECOVERY_BOUND_S = 4.0
LEGACY_TTL_S = 10.0  # torch's etcd backend: a node's key lives this long after its last keep-alive (hard-coded)


def _legacy_floor(event: dict) -> dict:
    """torch's etcd backend cannot drop a killed node before its TTL: the bar is that floor + 2 s."""
    rendezvous = (event.get("breakdown") or {}).get("rendezvous_s")
    return target("kill_rendezvous_legacy_etcd", f"kill: rendezvous <= keep-alive TTL {LEGACY_TTL_S:g} s + 2 s "
                  "(legacy etcd)", rendezvous, "<=", LEGACY_TTL_S + 2, _where_recovery_goes(event))


# A partition's two events: the split (first step on one side) and the heal (first step back at world 2).
EVENT_BOUNDS_S = {("partition", "cut"): 15.0, ("partition", "heal"): 10.0}


def _recovery_p50(results: dict) -> list[dict]:
    """The median recovery of each repeated etcd-v3 scenario against a fixed bound."""
    def bound(g: dict) -> float | None:
        return RECOVERY_BOUND_S if g["kind"] == g["scenario"] else EVENT_BOUNDS_S.get((g["scenario"], g["kind"]))

    def name(g: dict) -> str:
        return g["scenario"] if g["kind"] == g["scenario"] else f"{g['scenario']} {g['kind']}"

    return [target(f"{name(g).replace(' ', '_')}_recovery_p50_{g['backend']}",
                   f"{name(g)}: recovery p50 <= {bound(g):g} s ({g['backend']}, {g['world']})",
                   g["recovery_s"]["median"], "<=", bound(g),
                   f"median of {g['n']}, {sec(g['recovery_s']['min'])} to {sec(g['recovery_s']['max'])}; "
                   + _where_recovery_goes(g))
            for g in results["recovery"].get("summary") or [] if g["n"] > 1 and bound(g) is not None]


HEAL_EVERY_RUN_S = 3.0  # a healed partition: the world is whole again within this, in every run


def network(results: dict) -> list[dict]:
    """The network section's rules: each scenario's median, and every partition's heal on its own."""
    heals = [g for g in results["recovery"].get("summary") or [] if (g["scenario"], g["kind"]) == ("partition", "heal")]
    return _recovery_p50(results) + [
        target(f"partition_heal_every_run_{g['backend']}",
               f"partition heal: every run <= {HEAL_EVERY_RUN_S:g} s ({g['backend']}, {g['world']})",
               g["recovery_s"]["max"], "<=", HEAL_EVERY_RUN_S, f"{g['n']} runs, {sec(g['recovery_s']['min'])} to "
               f"{sec(g['recovery_s']['max'])}") for g in heals]


def judge(results: dict) -> list[dict]:
    return _throughput(results) + _overhead(results) + _recovery(results) + _recovery_p50(results)
