"""Elastic overhead: our trainer with periodic checkpoints at the default interval against the same run
with them off, interleaved; and how long each save blocks training against the median step.

Why these step counts: every epoch end evaluates and saves whatever --checkpoint-every says, so "off"
cannot mean zero saves on a run longer than an epoch. Below one epoch (468 steps) the window would be
~4 s of training, too short to resolve a 3% difference on a shared 2-core machine. So full runs span
1400 steps (~3 epochs): both variants do the same 2 epoch-end evaluations and saves in the measured
window, and the difference is exactly the periodic saves (13 of them) - the cost the interval controls.
"""

from __future__ import annotations

from pathlib import Path

from bench.runner import Runner, log, median, python_m, ratio, spread, supports
from bench.settings import Settings

WHY_STEPS = __doc__.split("Why these step counts: ", 1)[1].strip().replace("\n", " ")
BLOCK_KEYS = ("checkpoint_block_ms_p50", "checkpoint_block_ms_p95", "checkpoint_block_ms_max",
              "checkpoint_block_ms_mean", "checkpoints_saved", "step_ms_median", "samples_per_s", "train_time_s")


def steps_per_epoch(s: Settings) -> int:
    """From the label file's header: what decides which saves are epoch-end saves."""
    from elastic_mnist.data.mnist import RAW_FILES, read_idx

    return len(read_idx(Path(s.data_dir) / "MNIST" / "raw" / RAW_FILES[(True, "labels")])) // s.global_batch_size


def variants() -> dict[str, list[str]]:
    """'on' is the shipped default. When the trainer also keeps in-memory snapshots, 'off' turns those
    off too (all elastic state-saving off) and 'checkpoints_only' separates the two costs."""
    snapshots = supports("snapshot_every")
    out = {"on": ["--checkpoint-every", "100"],
           "off": ["--checkpoint-every", "0"] + (["--snapshot-every", "0"] if snapshots else [])}
    if snapshots:
        out["checkpoints_only"] = ["--checkpoint-every", "100", "--snapshot-every", "0"]
    return out


def _run(runner: Runner, s: Settings, name: str, flags: list[str]) -> dict:
    args = ["--data-dir", s.data_dir, "--max-steps", str(s.overhead_steps),
            "--global-batch-size", str(s.global_batch_size), *flags]
    summary = runner.trainer(1, args, f"overhead-{name}", s.timeout_s)
    rec = {"variant": name, **{k: summary.get(k) for k in BLOCK_KEYS}}
    for k in ("snapshots_taken", "snapshot_block_ms_p50"):
        if k in summary:
            rec[k] = summary[k]
    return {**rec, "saves": save_series(summary["log_dir"]), "wall_s": summary["wall_s"],
            "load_avg": summary["load_avg"], "command": summary["command"]}


def save_series(log_dir: str) -> list[list[float]]:
    """[step, block ms] of every save, from the trainer's TensorBoard scalars (the summary keeps only
    percentiles, and the outliers are what the block target is about)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    if "checkpoint/block_ms" not in acc.Tags().get("scalars", []):
        return []
    return [[e.step, round(e.value, 3)] for e in acc.Scalars("checkpoint/block_ms")]


def classify_saves(runs: list[dict], steps_per_epoch: int) -> dict:
    """Block time by kind of save: the run's first (caches and allocator still cold), epoch ends (right
    after the evaluation), the other periodic saves; and every save that blocked longer than its run's
    median step."""
    kinds: dict[str, list[float]] = {"first": [], "epoch_end": [], "periodic": []}
    over = []
    for r in runs:
        first_step = min((st for st, _ in r["saves"]), default=None)
        for st, ms in r["saves"]:
            kind = "epoch_end" if st % steps_per_epoch == 0 else "first" if st == first_step else "periodic"
            kinds[kind].append(ms)
            if ms > r["step_ms_median"]:
                over.append({"variant": r["variant"], "repeat": r["repeat"], "step": st, "block_ms": ms,
                             "kind": kind, "step_ms_median": r["step_ms_median"]})
    return {"by_kind": {k: {"n": len(v), "median_ms": median(v), "max_ms": max(v, default=None)}
                        for k, v in kinds.items()},
            "saves": sum(len(v) for v in kinds.values()), "longer_than_a_step": over}


def measure(runner: Runner, s: Settings) -> dict:
    """World size 1 (rank 0 is the only writer either way); variants alternate, reversed every repeat."""
    names = list(variants())
    runs = []
    for r in range(s.overhead_repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            log(f"overhead repeat {r + 1}/{s.overhead_repeats}: checkpointing {name} ({s.overhead_steps} steps) ...")
            rec = {**_run(runner, s, name, variants()[name]), "repeat": r}
            runs.append(rec)
            log(f"  {name}: {rec['samples_per_s']:,.0f} samples/s, median step {rec['step_ms_median']:.2f} ms, "
                f"{rec['checkpoints_saved']} saves, block p50 {rec['checkpoint_block_ms_p50']:.2f} ms "
                f"max {rec['checkpoint_block_ms_max']:.2f} ms")
    result = {"max_steps": s.overhead_steps, "why_max_steps": WHY_STEPS, "world_size": 1,
              "flags": variants(), "runs": runs, **summarize(runs),
              "saves": classify_saves(runs, steps_per_epoch(s)), "probe": probe(runner, s)}
    log(f"overhead: throughput cost {100 * result['throughput_cost']:.1f}% (paired median "
        f"{100 * result['throughput_cost_paired']:.1f}%), block p95 {result['on']['checkpoint_block_ms_p95']:.2f} ms "
        f"vs step {result['on']['step_ms_median']:.2f} ms")
    return result


def probe(runner: Runner, s: Settings) -> dict:
    """bench.save_cost: one save's blocking and background cost measured in-process, far less noisy
    than comparing whole runs on a shared machine. Checkpoints go to disk every 100 steps; in-memory
    snapshots (when the trainer has them) to tmpfs every --snapshot-every steps."""
    from elastic_mnist.config import TrainConfig

    targets = {"checkpoint": (str(runner.work_dir), 100)}
    if supports("snapshot_every") and TrainConfig().snapshot_every:
        targets["snapshot"] = ("/dev/shm", TrainConfig().snapshot_every)
    out = {}
    for name, (where, interval) in targets.items():
        log(f"overhead probe: anatomy of one {name} save (every {interval} steps, written under {where}) ...")
        cmd = python_m("bench.save_cost") + ["--data-dir", s.data_dir, "--interval", str(interval), "--dir", where,
                                             "--saves", "10" if s.mode == "full" else "4"]
        out[name] = runner.json_line(cmd, f"save-cost-{name}", s.timeout_s)
        p = out[name]
        log(f"  {name}: save call {p['save_call_ms']:.2f} ms, encode {p['encode_ms']:.2f} ms, write "
            f"{p['write_ms']:.2f} ms, +{p['extra_ms_per_save']:.2f} ms per save = "
            f"{100 * p['cost_at_interval']:.1f}% at every {interval} steps")
    return out


def summarize(runs: list[dict]) -> dict:
    by = {}
    for name in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == name]
        by[name] = {"samples_per_s": spread([r["samples_per_s"] for r in mine]),
                    "step_ms_median": median([r["step_ms_median"] for r in mine]),
                    "checkpoint_block_ms_p50": median([r["checkpoint_block_ms_p50"] for r in mine]),
                    "checkpoint_block_ms_p95": median([r["checkpoint_block_ms_p95"] for r in mine]),
                    "checkpoint_block_ms_max": max(r["checkpoint_block_ms_max"] for r in mine),
                    "checkpoints_saved": median([r["checkpoints_saved"] for r in mine])}
        if "snapshot_block_ms_p50" in mine[0]:
            by[name]["snapshot_block_ms_p50"] = median([r["snapshot_block_ms_p50"] for r in mine])
            by[name]["snapshots_taken"] = median([r["snapshots_taken"] for r in mine])
    on, off, only = by["on"], by["off"], by.get("checkpoints_only")
    paired = [1 - ratio(a["samples_per_s"], b["samples_per_s"])
              for a, b in zip(_of(runs, "on"), _of(runs, "off"))]
    blocking = [r["checkpoint_block_ms_mean"] * r["checkpoints_saved"] / (r["train_time_s"] * 1000)
                for r in _of(runs, "on") if r["train_time_s"]]
    return {**by, "throughput_cost": _cost(on, off),
            "throughput_cost_paired": median(paired),
            "step_time_cost": ratio(on["step_ms_median"], off["step_ms_median"]) - 1,
            # What the saves' blocking alone costs; the rest of any measured cost is the writer thread
            # competing for the same two cores.
            "blocking_cost": median(blocking),
            # The two costs apart, when the trainer also snapshots: periodic disk checkpoints alone.
            "throughput_cost_checkpoints_only": _cost(only, off) if only else None,
            "block_max_over_step_checkpoints_only": (ratio(only["checkpoint_block_ms_max"], only["step_ms_median"])
                                                     if only else None),
            "block_p95_over_step": ratio(on["checkpoint_block_ms_p95"], on["step_ms_median"]),
            "block_max_over_step": ratio(on["checkpoint_block_ms_max"], on["step_ms_median"])}


def _cost(variant: dict, off: dict) -> float:
    return 1 - ratio(variant["samples_per_s"]["median"], off["samples_per_s"]["median"])


def _of(runs: list[dict], name: str) -> list[dict]:
    return sorted((r for r in runs if r["variant"] == name), key=lambda r: r["repeat"])
