"""The benchmark suite: throughput, checkpoint overhead, recovery, time to accuracy (and GPU when present).

    python -m bench --data-dir ../shared/data --update-docs        # full: 15-25 min on 2 cores
    python -m bench --quick --out /tmp/bench                        # ~2 min, small generated data set
    python -m bench --spot-only --data-dir ../shared/data --update-docs   # the spot replay alone (bench/spot.py)
    python -m bench --network-only --data-dir ../shared/data --update-docs  # vanish, partition (root; bench/network.py)
    python -m bench --in-place-only --data-dir ../shared/data --update-docs  # in place, fresh, c10d (inplace.py)
    python -m bench --soak --data-dir ../shared/data --update-docs   # 500 changes: does anything grow (soak.py)
    python -m bench --scale-only --data-dir ../shared/data --update-docs  # a change at 2 to 8 nodes (scale.py)

Writes OUT/results.json (machine, settings, every number and the command lines), OUT/*.png and
OUT/table.md (generated from results.json); --update-docs also puts the table into docs/benchmarks.md
between `<!-- bench:start -->` and `<!-- bench:end -->` when both markers are there.
docs/benchmarks.md says what each section measures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import (
    elastic,
    inplace,
    network,
    overhead,
    plots,
    report,
    scale,
    settings,
    sharded,
    soak,
    spot,
    targets,
    throughput,
)
from bench.machine import describe, one_line
from bench.runner import REPO, BenchError, Runner, log

DEFAULT_OUT = REPO / "bench" / "results"
DOCS = REPO / "docs" / "benchmarks.md"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=os.environ.get("ELASTIC_MNIST_DATA_DIR", ""),
                   help="MNIST root (MNIST/raw/*-ubyte); --quick generates a small set when omitted")
    p.add_argument("--quick", action="store_true", help="a few dozen steps, 1 repeat, kill only, no time to accuracy")
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"where results go (default {DEFAULT_OUT})")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved repeats in full mode; with --network-only, runs of each scenario (default 3)")
    p.add_argument("--work-dir", default="", help="scratch for run dirs and checkpoints (default: a temp dir)")
    p.add_argument("--keep-work", action="store_true", help="keep the scratch dir (logs of every run)")
    p.add_argument("--update-docs", action="store_true",
                   help=f"rewrite {DOCS.relative_to(REPO)} between the bench markers")
    p.add_argument("--network-only", action="store_true",
                   help="only the network faults between hosts: vanish and partition, 3 runs each (root)")
    p.add_argument("--in-place-only", action="store_true",
                   help="only recovery in place against a fresh start and c10d, the storm and the frozen plain "
                        "torchrun node (~80 min; bench/inplace.py)")
    p.add_argument("--spot-only", action="store_true",
                   help="only the spot trace replay (three systems, ~20 min; full mode runs it after the rest)")
    p.add_argument("--soak", action="store_true",
                   help="only the soak: hundreds of membership changes, and whether anything grows (bench/soak.py)")
    p.add_argument("--scale-only", action="store_true",
                   help="only a kill, a preemption and a join at 2 to 8 nodes (~15 min; bench/scale.py)")
    p.add_argument("--sharded-only", action="store_true",
                   help="only sharded training under chaos: a 37M model's changes, a DCP restart, throughput (~5 min)")
    p.add_argument("--soak-changes", type=int, default=500, help="membership changes in the soak (default 500)")
    p.add_argument("--soak-parallel", choices=("ddp", "fsdp"), default="ddp",
                   help="how the soak's workers hold the model (default ddp; fsdp writes soak-fsdp.*)")
    p.add_argument("--spot-trace", default=str(spot.TRACE), help=f"the spot trace to replay (default {spot.TRACE})")
    p.add_argument("--spot-tick", type=float, default=None,
                   help=f"seconds per trace interval in the spot replay (default {spot.SpotSettings.tick_s}; "
                        f"{spot.WHOLE_TICK_S} with --spot-whole)")
    p.add_argument("--spot-whole", action="store_true",
                   help="with --spot-only: replay the entire trace once (3,664 intervals, three systems, ~70 min)")
    return p


def _settings(args, work: Path) -> settings.Settings:
    if args.quick:
        data = args.data_dir
        if not data:  # learnable stand-in in MNIST's IDX layout; both loaders read it
            from elastic_mnist.data.mnist import write_synthetic_mnist

            data = str(write_synthetic_mnist(work / "data", 2000, 500))
        return settings.quick(os.path.abspath(data))
    if not (Path(args.data_dir) / "MNIST" / "raw").is_dir():
        raise BenchError(f"--data-dir {args.data_dir!r} has no MNIST/raw; full mode measures real MNIST")
    return settings.full(os.path.abspath(args.data_dir), max(1, args.repeats))


def provenance() -> dict:
    """Which code was measured: the commit, uncommitted changes, and a hash of the measured sources
    (a commit that only touches tests or docs during a run does not change what was measured)."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=30,
                                  check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD")
    dirty = [line[3:] for line in git("status", "--porcelain").splitlines()
             if line[3:].startswith(("elastic_mnist/", "bench/")) and not line[3:].startswith("bench/results")]
    digest = hashlib.sha256()
    for path in sorted([*REPO.glob("elastic_mnist/**/*.py"), *REPO.glob("bench/*.py")]):
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    desc = f"commit {commit[:10] or 'unknown'}" + (f" + uncommitted changes to {len(dirty)} file(s)" if dirty else "")
    return {"commit": commit, "uncommitted": dirty, "code_sha256": digest.hexdigest()[:16], "describe": desc}


def measure(s: settings.Settings, runner: Runner) -> dict:
    results = {"throughput": throughput.measure(runner, s), "checkpoint_overhead": overhead.measure(runner, s),
               "recovery": elastic.measure_recovery(runner, s)}
    if s.tta_epochs:
        results["time_to_accuracy"] = elastic.measure_tta(runner, s)
    else:
        results["time_to_accuracy"] = {"skipped": "quick mode", "threshold": s.tta_threshold, "epochs": 0, "runs": []}
    results["gpu"] = throughput.measure_gpu(runner, s)
    return results


def commands(obj) -> list[str]:
    """Every command line recorded anywhere in the results, in order."""
    if isinstance(obj, dict):
        return ([obj["command"]] if isinstance(obj.get("command"), str) else []) + [
            c for k, v in obj.items() if k != "command" for c in commands(v)]
    if isinstance(obj, list):
        return [c for v in obj for c in commands(v)]
    return []


def write_outputs(results: dict, out: Path, update_docs: bool, docs: Path = DOCS) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plots.draw_all(results, out)
    (out / "results.json").write_text(json.dumps(_finite(results), indent=2) + "\n")
    (out / "table.md").write_text(report.render(results))
    log(f"wrote {out / 'results.json'}, {out / 'table.md'} and {', '.join(results['plots'])}")
    if update_docs:
        prefix = os.path.relpath(out, docs.parent) + "/"
        if report.update_between_markers(docs, report.render(results, image_prefix=prefix)):
            log(f"updated {docs} between the bench markers")
        else:
            log(f"{docs} has no {report.START} ... {report.END} markers: left unchanged")


def _finite(obj):
    """JSON has no NaN/inf: a number that is not finite is written as null, never as invalid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="elastic-mnist-bench-"))
    started = time.time()
    if args.spot_only or args.network_only or args.in_place_only or args.soak or args.scale_only or args.sharded_only:
        try:
            if args.sharded_only:
                return run_sharded(args, work)
            if args.soak:
                return run_soak(args, work)
            if args.scale_only:
                return run_scale(args, work)
            if args.in_place_only:
                return run_in_place(args, work)
            return run_spot(args, work) if args.spot_only else run_network(args, work)
        finally:
            if not args.keep_work and not args.work_dir:
                shutil.rmtree(work, ignore_errors=True)
    try:
        s = _settings(args, work)
        machine = describe()
        log(f"{s.mode} run on {one_line(machine)}; scratch {work}")
        results = {"schema": 1, "mode": s.mode, "settings": s.to_dict(), "machine": machine,
                   "provenance": provenance(), "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        results.update(measure(s, Runner(work)))
        results["targets"] = targets.judge(results)
        end = provenance()  # the tree may move under a long run (others commit while it measures)
        if end["code_sha256"] != results["provenance"]["code_sha256"]:
            results["provenance"]["at_end"] = end
            results["provenance"]["describe"] += (f"; at the end {end['describe']} "
                                                  "(measured code CHANGED during the run)")
        results.update(finished_at=time.strftime("%Y-%m-%d %H:%M:%S %Z"), wall_s=round(time.time() - started, 1))
        results["commands"] = commands({k: v for k, v in results.items() if k != "commands"})
        write_outputs(results, Path(args.out), args.update_docs)
        if s.mode == "full":
            run_spot(args, work)
    except BenchError as e:
        log(f"error: {e}")
        return 1
    finally:
        if not args.keep_work and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    for t in results["targets"]:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        log(f"target {t['id']}: {verdict} ({t['value']} {t['op']} {t['threshold']}) {t['detail']}")
    log(f"done in {time.time() - started:.0f} s")
    return 0


def run_soak(args, work: Path) -> int:
    """The soak; OUT/soak.json, soak.png, soak.md (and docs with --update-docs)."""
    if not (Path(args.data_dir) / "MNIST" / "raw").is_dir():
        log(f"error: --data-dir {args.data_dir!r} has no MNIST/raw")
        return 1
    result = soak.measure(Path(args.out), os.path.abspath(args.data_dir), max(2, args.soak_changes), work,
                          args.soak_parallel)
    result.update(provenance=provenance(), finished_at=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    if not soak.write(result, Path(args.out), DOCS if args.update_docs else None):
        log(f"{DOCS} has no {' ... '.join(soak.markers(args.soak_parallel))} markers: left unchanged")
    for t in result["targets"]:
        log(f"target {t['id']}: {({True: 'met', False: 'MISSED', None: 'not measured'})[t['met']]} ({t['value']})")
    return 0 if result["changes"] == result["changes_scheduled"] else 1  # the launcher ends it: not 0


def run_scale(args, work: Path) -> int:
    """A change against the job's size; OUT/scale.json, scale.md (and docs with --update-docs)."""
    return _run_section(scale, args, work)


def run_sharded(args, work: Path) -> int:
    """Sharded training under chaos; OUT/sharded.json, sharded.md (and docs with --update-docs)."""
    return _run_section(sharded, args, work)


def _run_section(section, args, work: Path) -> int:
    """One section's measure, its result with the tree and the machine, its outputs; 0 when no row failed."""
    started = time.time()
    result = section.measure(Runner(work), os.path.abspath(args.data_dir))
    result.update(provenance=provenance(), machine=describe(), wall_s=round(time.time() - started, 1),
                  finished_at=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    if not section.write(result, Path(args.out), DOCS if args.update_docs else None):
        log(f"{DOCS} has no {section.START} ... {section.END} markers: left unchanged")
    return 0 if all("error" not in r for r in result["rows"]) else 1


def run_network(args, work: Path) -> int:
    """Vanish and partition recovery; OUT/network.json, network.md (and docs with --update-docs)."""
    started = time.time()
    try:
        s = _settings(args, work)
        result = network.measure(Runner(work), s, runs=max(1, args.repeats))
    except BenchError as e:
        log(f"error: {e}")
        return 1
    result.update(provenance=provenance(), machine=describe(), wall_s=round(time.time() - started, 1),
                  finished_at=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    if not network.write(result, Path(args.out), DOCS if args.update_docs else None):
        log(f"{DOCS} has no {network.START} ... {network.END} markers: left unchanged")
    for t in result["targets"]:
        log(f"target {t['id']}: {'met' if t['met'] else 'MISSED'} ({t['value']}) {t['detail']}")
    log(f"network faults done in {time.time() - started:.0f} s; wrote {Path(args.out) / 'network.json'}")
    return 0


def run_in_place(args, work: Path) -> int:
    """Recovery in place, fresh and c10d, the storm, the frozen plain-torchrun node; OUT/inplace.json and .md."""
    if not (Path(args.data_dir) / "MNIST" / "raw").is_dir():
        log(f"error: --data-dir {args.data_dir!r} has no MNIST/raw; the in-place section trains real MNIST")
        return 1
    started = time.time()
    try:
        result = inplace.measure(Runner(work), inplace.InPlaceSettings(os.path.abspath(args.data_dir),
                                                                        repeats=args.repeats))
    except BenchError as e:
        log(f"error: {e}")
        return 1
    machine = describe()
    result.update(provenance=provenance(), machine=machine, machine_line=one_line(machine),
                  wall_s=round(time.time() - started, 1), finished_at=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    inplace.write(result, Path(args.out), DOCS if args.update_docs else None)
    for t in result["targets"]:
        log(f"target {t['id']}: {'met' if t['met'] else 'MISSED'} ({t['value']}) {t['detail']}")
    log(f"in-place section done in {time.time() - started:.0f} s; wrote {Path(args.out) / 'inplace.json'}")
    return 0


def run_spot(args, work: Path) -> int:
    """The spot replay's three systems; OUT/spot.json, spot.md, spot.png (and docs with --update-docs)."""
    if not (Path(args.data_dir) / "MNIST" / "raw").is_dir():
        log(f"error: --data-dir {args.data_dir!r} has no MNIST/raw; the spot replay trains real MNIST")
        return 1
    started = time.time()
    try:
        tick = args.spot_tick or (spot.WHOLE_TICK_S if args.spot_whole else spot.SpotSettings.tick_s)
        result = spot.measure(Runner(work), spot.SpotSettings(
            os.path.abspath(args.data_dir), trace=args.spot_trace, tick_s=tick,
            window="" if args.spot_whole else spot.SpotSettings.window))
    except BenchError as e:
        log(f"error: {e}")
        return 1
    result.update(provenance=provenance(), machine=describe(), wall_s=round(time.time() - started, 1))
    spot.write(result, Path(args.out), DOCS if args.update_docs else None)
    for t in result["targets"]:
        log(f"target {t['id']}: {'met' if t['met'] else 'MISSED'} ({t['value']}) {t['detail']}")
    name = spot._name(result["settings"])
    log(f"spot replay done in {time.time() - started:.0f} s; wrote {Path(args.out) / (name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
