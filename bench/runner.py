"""Running the measured programs: one environment for every child, the command line recorded, progress
printed as each number arrives.

    from bench.runner import Runner; Runner(work_dir).json_line(["python", "-m", "bench.bare_loop", ...])
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from elastic_mnist import procs

REPO = Path(__file__).resolve().parents[1]


class BenchError(RuntimeError):
    """A measured program failed or printed no result; the message carries its output's tail."""


def child_env() -> dict[str, str]:
    """Every process we launch gets one thread, even where the caller set more: the machine has few
    cores and runs several processes, and every implementation must run alike."""
    return procs.child_env(OMP_NUM_THREADS="1")


def torchrun(nproc: int, module: str, module_args: list[str]) -> list[str]:
    """Real torchrun with a standalone rendezvous, running `python -m module module_args` per worker."""
    return procs.torchrun_command(["--standalone", f"--nproc-per-node={nproc}"], module_args, module)


def python_m(module: str) -> list[str]:
    return [sys.executable, "-m", module]


def shown(cmd: list[str]) -> str:
    """The command as a user would paste it (the one env var we set included)."""
    return "OMP_NUM_THREADS=1 " + shlex.join(cmd)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_avg() -> float:
    """1-minute load average: how busy the (shared) machine was around a run."""
    return round(os.getloadavg()[0], 2)


class Runner:
    def __init__(self, work_dir: str | Path):
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._seq = 0

    def new_dir(self, name: str) -> Path:
        self._seq += 1
        path = self.work_dir / f"{self._seq:03d}-{name}"
        path.mkdir(parents=True)
        return path

    def run(self, cmd: list[str], log_path: Path, timeout: float) -> tuple[int, float, float]:
        """Run to completion with output in log_path; (exit code, wall seconds, load average before)."""
        load = load_avg()
        t0 = time.perf_counter()
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # SIGTERM first: a launcher stops its nodes on it. A SIGKILL alone would leave a SIGSTOPped
                # node's workers behind (stopped, they never act on their parent's death).
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                rc = 124
        return rc, time.perf_counter() - t0, load

    def json_line(self, cmd: list[str], name: str, timeout: float = 600) -> dict:
        """Run a program that prints its result as one JSON object line (the loops, the save probe)."""
        out_dir = self.new_dir(name)
        rc, wall, load = self.run(cmd, out_dir / "output.log", timeout)
        text = (out_dir / "output.log").read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith("{") and ln.rstrip().endswith("}")]
        if rc != 0 or not lines:
            raise BenchError(f"{shown(cmd)} exited {rc} without a result:\n{text[-3000:]}")
        return {**json.loads(lines[-1]), "wall_s": round(wall, 2), "load_avg": load, "command": shown(cmd)}

    def trainer(self, nproc: int, train_args: list[str], name: str, timeout: float = 600) -> dict:
        """Our worker under torchrun; its summary.json is the result."""
        out_dir = self.new_dir(name)
        cmd = torchrun(nproc, "elastic_mnist.train", [*train_args, "--checkpoint-dir", str(out_dir / "ckpt"),
                                                      "--log-dir", str(out_dir / "logs")])
        shm = None
        if supports("snapshot_dir") and "--snapshot-dir" not in train_args:
            # In-memory snapshots stay in memory (tmpfs) as by default, but in a directory we remove.
            shm = Path("/dev/shm" if os.path.isdir("/dev/shm") else out_dir) / f"elastic-mnist-bench-{os.getpid()}"
            cmd += ["--snapshot-dir", str(shm / out_dir.name)]
        try:
            rc, wall, load = self.run(cmd, out_dir / "output.log", timeout)
        finally:
            if shm is not None:
                shutil.rmtree(shm, ignore_errors=True)
        summary_path = out_dir / "logs" / "summary.json"
        if rc != 0 or not summary_path.exists():
            text = (out_dir / "output.log").read_text(errors="replace")
            raise BenchError(f"{shown(cmd)} exited {rc} without summary.json:\n{text[-3000:]}")
        summary = json.loads(summary_path.read_text())
        return {**summary, "world_size": summary["world_size"], "wall_s": round(wall, 2), "load_avg": load,
                "command": shown(cmd), "log_dir": str(out_dir / "logs")}


def supports(field_name: str) -> bool:
    """Whether the trainer has a flag: the suite measures the tree as it is, flags come and go."""
    from dataclasses import fields

    from elastic_mnist.config import TrainConfig

    return any(f.name == field_name for f in fields(TrainConfig))


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def spread(values: list[float]) -> dict:
    """Median with min and max, so the noise of a shared machine stays visible."""
    values = [v for v in values if v is not None]
    return {"median": median(values), "min": min(values, default=None), "max": max(values, default=None),
            "n": len(values)}
