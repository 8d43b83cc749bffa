"""The GPU check: one command on a machine with CUDA, a JSON summary at the end (and in --out).

    python -m bench.gpu_check --data-dir ../shared/data       # writes bench/results/gpu_check.json
    python -m bench.gpu_check --data-dir ../shared/data --dry-run      # no GPU: all of it on CPU with gloo

What it runs (a real torchrun with --standalone, unless it says in-process):
- train: one worker on one GPU with NCCL at world size 1 (--backend nccl), its samples/s and test accuracy;
- resume: the same run stopped at step A and started again: it must resume at A and finish at B;
- precision: the same worker with --precision bf16 and with fp16 (its GradScaler), each trained and resumed;
- throughput: our worker against the bare loop (bench.bare_loop --device cuda), one process each;
- in-process (bench/gpu_single.py): a resume that restores the CUDA RNG as saved; the abort path (the
  watch thread aborts the data group while the main thread is blocked in a collective, then saves the
  last agreed step); peak GPU memory with and without the failure-state copy;
- sharded (--parallel fsdp): fully_shard at world 1, a resume from its sharded (DCP) checkpoint, throughput
- peer loss (two or more GPUs; on --dry-run two CPU ranks): two ranks, rank 1 kills itself inside the
  gradient all-reduce (ELASTIC_MNIST_FAULT); reported: the survivor's detection time, the path that saved
  the state (the main thread after an error, or the peer watch), the steps redone, and completion;
- resizes (two or more GPUs, one per node; on --dry-run CPU): two etcd-v3 agents, a kill, a join and a
  SIGTERM; per node the worker processes (CUDA contexts), rounds and NCCL communicators (bench/gpu_resizes.py).
--dry-run exercises every step except CUDA, so this script cannot rot on machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import machine
from bench.runner import REPO, Runner, log, python_m
from elastic_mnist import procs
from elastic_mnist.compat.private import fresh_worker_store
from elastic_mnist.runlog import read_records
from elastic_mnist.state import fence

STEPS, RESUME_AT, FAULT_STEP, PRECISION_STOP = 400, 200, 60, 25


def _train(work: Path, name: str, check: Check, nproc: int, steps: int, env: dict | None = None,
           extra: tuple = ()) -> dict:
    """One torchrun run with a fixed checkpoint dir (so a second call resumes); its log and summary."""
    args = [f"--data-dir={check.data_dir}", f"--checkpoint-dir={work / 'ckpt'}", f"--log-dir={work / 'runs'}",
            f"--sample-log={work / 'samples'}", f"--max-steps={steps}", "--epochs=1000", f"--backend={check.backend}",
            "--log-every=100", f"--snapshot-dir={work / 'shm'}", *extra]
    cmd = procs.torchrun_command(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=3",
                                  f"--rdzv-id={name}"], args)
    log_path = work / f"{name}.log"
    t0 = time.time()
    # torch's c10d rendezvous (--standalone) shares one store across rounds too: the same guard as etcd-v3.
    env = fresh_worker_store(dict(env or {}))
    with open(log_path, "wb") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=procs.child_env(**env),
                            cwd=REPO, timeout=480).returncode
    text = log_path.read_text(errors="replace")
    summary_path = work / "runs" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"rc": rc, "wall_s": round(time.time() - t0, 2), "summary": summary, "log": text}


def check_train_and_resume(work: Path, check: Check) -> dict:
    first = _train(work, "resume-a", check, 1, RESUME_AT)
    second = _train(work, "resume-b", check, 1, STEPS)
    resumed = re.search(r"\[resume\] step (\d+)", second["log"])
    return {"ok": first["rc"] == 0 and second["rc"] == 0 and resumed is not None
            and int(resumed.group(1)) == RESUME_AT and second["summary"].get("global_step") == STEPS,
            "resumed_at": int(resumed.group(1)) if resumed else None,
            "final_step": second["summary"].get("global_step"), "samples_per_s": second["summary"].get("samples_per_s"),
            "test_accuracy": second["summary"].get("test_accuracy"), "exit_codes": [first["rc"], second["rc"]]}


def check_precision(work: Path, check: Check) -> dict:
    """bf16 and fp16 (GradScaler) on the device: each trained to PRECISION_STOP, then resumed to the end."""
    out = {}
    for precision in ("bf16", "fp16"):
        where = work / precision
        where.mkdir(parents=True, exist_ok=True)
        first = _train(where, f"{precision}-a", check, 1, PRECISION_STOP, extra=(f"--precision={precision}",))
        second = _train(where, f"{precision}-b", check, 1, 2 * PRECISION_STOP, extra=(f"--precision={precision}",))
        resumed = re.search(r"\[resume\] step (\d+)", second["log"])
        out[precision] = {"ok": first["rc"] == second["rc"] == 0 and resumed is not None
                          and int(resumed.group(1)) == PRECISION_STOP, "resumed_at": resumed and int(resumed.group(1)),
                          "samples_per_s": second["summary"].get("samples_per_s"),
                          "test_accuracy": second["summary"].get("test_accuracy")}
    return {"ok": all(v["ok"] for v in out.values()), **out}


def check_sharded(work: Path, check: Check) -> dict:
    """--parallel fsdp on one device: fully_shard at world 1, trained to PRECISION_STOP and saved through DCP,
    resumed from that sharded checkpoint to twice as far; its throughput."""
    extra = ("--parallel=fsdp", "--checkpoint-every=0")
    first = _train(work, "sharded-a", check, 1, PRECISION_STOP, extra=extra)
    second = _train(work, "sharded-b", check, 1, 2 * PRECISION_STOP, extra=extra)
    resumed = re.search(r"\[resume\] step (\d+)", second["log"])
    shards = sorted(p.name for p in (work / "ckpt").glob("ckpt-*.shards"))
    return {"ok": first["rc"] == second["rc"] == 0 and resumed is not None and int(resumed.group(1)) == PRECISION_STOP
            and bool(shards) and second["summary"].get("global_step") == 2 * PRECISION_STOP,
            "resumed_at": resumed and int(resumed.group(1)), "shards": shards,
            "samples_per_s": second["summary"].get("samples_per_s"),
            "test_accuracy": second["summary"].get("test_accuracy")}


def check_in_process(work: Path, check: Check) -> dict:
    from bench import gpu_single  # builds trainers in this process: imported only when it runs

    device = torch.device(check.device, 0) if check.device == "cuda" else torch.device("cpu")
    result = gpu_single.run(work, check.data_dir, device, check.backend)
    return {"ok": all(v["ok"] for v in result.values()), **result}


def check_throughput(work: Path, check: Check) -> dict:
    ours = _train(work, "throughput", check, 1, STEPS)["summary"].get("samples_per_s")
    bare = check.runner.json_line(python_m("bench.bare_loop") + ["--data-dir", check.data_dir, "--steps", str(STEPS),
                                                                  "--device", check.device], "bare")["samples_per_s"]
    return {"ours_samples_per_s": ours, "bare_samples_per_s": bare,
            "ours_vs_bare": round(ours / bare, 3) if ours else None}


def check_peer_loss(work: Path, check: Check) -> dict:
    if check.gpus < 2 and not check.dry_run:
        return {"skipped": f"needs 2 GPUs, this machine has {check.gpus}"}
    run = _train(work, "peer-loss", check, 2, STEPS // 2,
                 env={"ELASTIC_MNIST_FAULT": f"kill:rank=1:step={FAULT_STEP}:at=data"})
    fault = re.search(r"\[fault\] kill at step \d+ \(data\) time ([\d.]+)", run["log"])
    events = read_records(str(work / "runs" / "events"))
    lost = [e for e in events if e["event"] == "peer_lost"]
    paths = [e["event"] for e in events if e["event"] in ("saved_by_watch", "collective_failed")]
    counts = Counter(r["step"] for r in read_records(str(work / "samples")) if r["rank"] == 0)
    return {"ok": run["rc"] == 0 and fault is not None and bool(lost),
            "detection_s": round(lost[0]["time"] - float(fault.group(1)), 3) if fault and lost else None,
            "saved_by": paths, "steps_redone": sum(n - 1 for n in counts.values()),
            "completed": fence.read_finished(str(work / "ckpt")) is not None, "exit_code": run["rc"]}


def check_resizes(work: Path, check: Check) -> dict:
    if check.gpus < 2 and not check.dry_run:
        return {"skipped": f"needs 2 GPUs (one per node), this machine has {check.gpus}"}
    from bench import gpu_resizes

    return gpu_resizes.run(work, check.data_dir, check.backend, check.gpus)


@dataclass
class Check:
    data_dir: str
    dry_run: bool
    runner: Runner
    backend: str = "nccl"
    device: str = "cuda"
    gpus: int = 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--dry-run", action="store_true", help="run everything on CPU with gloo (no CUDA needed)")
    p.add_argument("--out", default="", help="also write the JSON summary here (default on a GPU: "
                   "bench/results/gpu_check.json; none with --dry-run)")
    p.add_argument("--work-dir", default="", help="where runs go (default: a fresh dir under /tmp)")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench.gpu_check: error: no CUDA device visible; run with --dry-run to check on CPU", file=sys.stderr)
        return 2
    check = Check(args.data_dir, args.dry_run,
                  Runner(args.work_dir or f"/tmp/elastic-mnist-gpu-check-{int(time.time())}"))
    if args.dry_run:
        check.backend, check.device = "gloo", "cpu"
    else:
        check.gpus = torch.cuda.device_count()
    result = {"machine": machine.describe(), "dry_run": args.dry_run, "backend": check.backend, "gpus": check.gpus}
    for name, fn in (("train_and_resume", check_train_and_resume), ("precision", check_precision),
                     ("sharded", check_sharded), ("throughput", check_throughput), ("in_process", check_in_process),
                     ("peer_loss", check_peer_loss), ("resizes", check_resizes)):
        log(f"gpu check: {name} ...")
        result[name] = fn(check.runner.new_dir(name), check)
        log(f"  {json.dumps(result[name])[:300]}")
    text = json.dumps(result, indent=2)
    out = args.out or ("" if args.dry_run else str(REPO / "bench" / "results" / "gpu_check.json"))
    if out:
        Path(out).write_text(text + "\n")
    print(text, flush=True)
    return 0 if all(v.get("ok", True) for v in result.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
