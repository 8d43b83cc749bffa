"""Throughput: our trainer against the seed article's loop and the bare single-process ceiling, at world
sizes 1 and 2, interleaved and repeated; plus the same on a GPU when one is present.

    python -m bench --quick --out /tmp/b      # runs this section among the others
"""

from __future__ import annotations

import torch

from bench.fmt import times
from bench.runner import Runner, log, python_m, ratio, spread, torchrun
from bench.settings import Settings

# bare exists only at world 1: it is the single-process ceiling. "dataloader" is our trainer on its
# DataLoader input path (torchvision's MNIST, per-sample transforms, 2 loader workers).
CONFIGS = [("bare", 1), ("seed", 1), ("ours", 1), ("dataloader", 1), ("seed", 2), ("ours", 2)]
DATALOADER_FLAGS = ("--input", "dataloader", "--num-workers", "2")


def _loop_args(s: Settings) -> list[str]:
    return ["--data-dir", s.data_dir, "--steps", str(s.steps), "--warmup", str(s.warmup),
            "--global-batch-size", str(s.global_batch_size)]


def _ours_args(s: Settings, *extra: str) -> list[str]:
    # The trainer's step timer leaves out the warm-up steps: max-steps = warm-up + measured steps.
    return ["--data-dir", s.data_dir, "--max-steps", str(s.warmup + s.steps),
            "--global-batch-size", str(s.global_batch_size), *extra]


def run_one(runner: Runner, s: Settings, impl: str, world: int, extra: tuple = ()) -> dict:
    name = f"throughput-{impl}-w{world}"
    if impl == "bare":
        rec = runner.json_line(python_m("bench.bare_loop") + _loop_args(s), name, s.timeout_s)
    elif impl == "seed":
        rec = runner.json_line(torchrun(world, "bench.seed_loop", _loop_args(s)), name, s.timeout_s)
    else:
        flags = (*extra, *DATALOADER_FLAGS) if impl == "dataloader" else extra
        rec = runner.trainer(world, _ours_args(s, *flags), name, s.timeout_s)
    keep = ("samples_per_s", "step_ms_median", "wall_s", "load_avg", "command")
    out = {"impl": impl, "world_size": world, **{k: rec[k] for k in keep}}
    # Rate from the median step: what a step costs when the shared machine is not busy elsewhere.
    out["median_step_samples_per_s"] = s.global_batch_size * 1000 / rec["step_ms_median"]
    return out


def measure(runner: Runner, s: Settings) -> dict:
    """Every repeat runs every configuration, each repeat in a rotated order, so load drift on the
    shared machine spreads over all of them rather than landing on one."""
    runs = []
    for r in range(s.repeats):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        for impl, world in order:
            log(f"throughput repeat {r + 1}/{s.repeats}: {impl} world {world} ({s.steps} steps) ...")
            rec = {**run_one(runner, s, impl, world), "repeat": r}
            runs.append(rec)
            log(f"  {impl} world {world}: {rec['samples_per_s']:,.0f} samples/s, median step "
                f"{rec['step_ms_median']:.2f} ms (load {rec['load_avg']}, {rec['wall_s']:.1f} s)")
    result = {"steps": s.steps, "warmup": s.warmup, "global_batch_size": s.global_batch_size,
              "ours_flags": "defaults (--checkpoint-every 100, evaluation at epoch end only)",
              "runs": runs, "summary": summarize(runs)}
    for world, row in result["summary"].items():
        log(f"throughput world {world}: ours/seed {times(row['ours_vs_seed'])}, ours/bare {times(row['ours_vs_bare'])}")
    return result


def summarize(runs: list[dict]) -> dict:
    """Per world size: median (min, max) of each implementation, and ours over seed and over bare.
    The bare ceiling is one process, so every world size is compared with it."""
    def pick(impl: str, world: int | None, key: str) -> dict:
        return spread([r[key] for r in runs if r["impl"] == impl and world in (None, r["world_size"])])

    bare, bare_step = pick("bare", None, "samples_per_s"), pick("bare", None, "median_step_samples_per_s")
    out = {}
    for world in sorted({r["world_size"] for r in runs}):
        ours, seed = pick("ours", world, "samples_per_s"), pick("seed", world, "samples_per_s")
        ours_step, seed_step = pick("ours", world, "median_step_samples_per_s"), pick(
            "seed", world, "median_step_samples_per_s")
        loader = pick("dataloader", world, "samples_per_s")
        out[str(world)] = {
            "ours": ours, "seed": seed, "bare": bare, "dataloader": loader,
            "dataloader_vs_ours": ratio(loader["median"], ours["median"]),
            "ours_vs_seed": ratio(ours["median"], seed["median"]),
            "ours_vs_bare": ratio(ours["median"], bare["median"]),
            "median_step": {"ours": ours_step, "seed": seed_step, "bare": bare_step,
                            "ours_vs_seed": ratio(ours_step["median"], seed_step["median"]),
                            "ours_vs_bare": ratio(ours_step["median"], bare_step["median"])}}
    return out


def measure_gpu(runner: Runner, s: Settings) -> dict | None:
    """Our trainer with NCCL on the GPU(s) this machine has; None when it has none."""
    if not torch.cuda.is_available():
        log("gpu: torch.cuda.is_available() is False: the GPU section was not run")
        return None
    worlds = [1] + ([2] if torch.cuda.device_count() >= 2 else [])
    runs = []
    for r in range(s.repeats):
        for world in worlds:
            log(f"gpu repeat {r + 1}/{s.repeats}: ours world {world} --backend nccl ...")
            rec = {**run_one(runner, s, "ours", world, ("--backend", "nccl")), "repeat": r}
            runs.append(rec)
            log(f"  gpu world {world}: {rec['samples_per_s']:,.0f} samples/s")
    return {"device": torch.cuda.get_device_name(0), "device_count": torch.cuda.device_count(), "runs": runs,
            "summary": {str(w): spread([r["samples_per_s"] for r in runs if r["world_size"] == w]) for w in worlds}}
