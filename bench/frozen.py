"""A frozen node under plain torchrun: two agents started with the README's etcd-v3 command plus
`--rdzv-conf last_call_timeout=2`, every process of node 1 SIGSTOPped mid-run; what the survivor waits, from
the last step anyone trained to its first step alone.

    python -m bench --in-place-only ...      # part of the in-place section (bench/inplace.py)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

from bench.runner import BenchError, Runner, child_env, log, shown, spread
from elastic_mnist import procs
from elastic_mnist.config import SHM_SNAPSHOTS
from elastic_mnist.runlog import read_records
from elastic_mnist.state import snapshots

TORCHRUN = ["--nnodes=1:4", "--nproc-per-node=1", "--rdzv-backend=etcd-v3", "--max-restarts=100",
            "--monitor-interval=0.1", "--rdzv-conf=last_call_timeout=2"]  # the README's, and a user's key


def measure_frozen_plain(runner: Runner, data_dir: str, repeats: int) -> dict:
    from elastic_mnist.etcd.server import EtcdServer

    runs = []
    with EtcdServer(enable_v2=False) as etcd:
        for i in range(repeats):
            runs.append(_one(runner, etcd.endpoint, data_dir, i))
            log(f"frozen (plain torchrun) #{i + 1}: stall {runs[-1]['stall_s']:.2f} s")
    return {"stall_s": spread([r["stall_s"] for r in runs]), "runs": runs}


def _one(runner: Runner, endpoint: str, data_dir: str, i: int) -> dict:
    work, run_id = runner.new_dir(f"frozen-plain-{i}"), f"frozen-{os.getpid()}-{i}"
    cmd = procs.torchrun_command([*TORCHRUN, f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"], [
        "--data-dir", data_dir, "--checkpoint-dir", str(work / "ckpt"), "--log-dir", str(work / "runs"),
        "--sample-log", str(work / "samples"), "--max-steps", "100000", "--min-step-time", "0.05"])
    agents = [_start(cmd, work / f"node{n}.log") for n in range(2)]
    try:
        procs.wait_for(lambda: len(_steps(work, 2)) >= 40, 180, "both nodes training")
        procs.signal_tree(agents[1].pid, signal.SIGSTOP)
        alone = procs.wait_for(lambda: _steps(work, 1), 120, "the survivor training alone")
        first = min(r["time"] for r in alone)
        last = max(r["time"] for r in read_records(str(work / "samples")) if r["time"] < first)
        return {"stall_s": round(first - last, 3), "command": shown(cmd)}
    except TimeoutError as e:
        raise BenchError(f"{shown(cmd)}: {e}") from None
    finally:
        for agent in agents:
            procs.signal_tree(agent.pid, signal.SIGKILL)
            agent.wait()
        # the killed job's in-memory snapshots (its default --snapshot-dir): nothing else removes them
        shutil.rmtree(os.path.join(snapshots.root_of(SHM_SNAPSHOTS), snapshots.run_name(run_id)), ignore_errors=True)


def _start(cmd: list[str], log_path) -> subprocess.Popen:
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True, preexec_fn=procs.die_with_parent_preexec())


def _steps(work, world: int) -> list[dict]:
    return [r for r in read_records(str(work / "samples")) if r["world_size"] == world]
