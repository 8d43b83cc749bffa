"""Three resizes under etcd-v3 with rounds in place, and what each node created for them: worker processes
(each holds one CUDA context), rounds served, and NCCL communicators (NCCL_DEBUG=INFO's "Init COMPLETE").

    python -m bench.gpu_check --data-dir ../shared/data          # part of the GPU check (two GPUs or more)
    python -m bench.gpu_check --data-dir ../shared/data --dry-run  # the same on CPU with gloo (no communicators)

Two torchrun agents (the README's etcd-v3 command, one GPU each through CUDA_VISIBLE_DEVICES) train; then
node 1 is SIGKILLed (2 -> 1), a new node 1 joins (1 -> 2) and its agent is SIGTERMed (2 -> 1); node 0 then
trains 20 more steps and is SIGTERMed. The goal: node 0 keeps one process, hence one CUDA context, through
all four rounds (five when it started alone), and forms one communicator per round (a fresh start would
create a process and a context per round).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

from elastic_mnist import procs
from elastic_mnist.contract.env import NODE_ENV
from elastic_mnist.runlog import read_records, worker_round

NCCL_INIT = re.compile(r"^\S+:(\d+):\d+ \[\d+\] NCCL INFO .*Init COMPLETE", re.MULTILINE)
TORCHRUN = ["--nnodes=1:4", "--nproc-per-node=1", "--rdzv-backend=etcd-v3", "--max-restarts=100",
            "--monitor-interval=0.1"]


def run(work: Path, data_dir: str, backend: str, gpus: int) -> dict:
    from elastic_mnist.etcd.server import EtcdServer

    with EtcdServer(enable_v2=False) as etcd:
        rdzv = [f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id=resizes-{os.getpid()}"]
        cmd = procs.torchrun_command([*TORCHRUN, *rdzv], [
            f"--data-dir={data_dir}", f"--checkpoint-dir={work / 'ckpt'}", f"--log-dir={work / 'runs'}",
            f"--snapshot-dir={work / 'snapshots'}",  # not /dev/shm: the killed agents leave their snapshots
            f"--sample-log={work / 'samples'}", "--max-steps=100000", "--epochs=1000", f"--backend={backend}",
            "--min-step-time=0.02", "--log-every=100"])
        agents: dict[str, subprocess.Popen] = {}
        try:
            changes = _resize(work, cmd, agents, gpus)
        finally:
            for agent in agents.values():
                procs.signal_tree(agent.pid, signal.SIGKILL)
                agent.wait()
    nodes = _count(work)
    n0 = nodes.get("n0", {})
    return {"ok": n0.get("processes") == 1 and n0.get("rounds", 0) >= 4,  # 5 when n0 first trained alone
            "changes": changes, "nodes": nodes,
            "command": " ".join(cmd)}


def _resize(work: Path, cmd: list[str], agents: dict, gpus: int) -> list[str]:
    for node in ("n0", "n1"):
        agents[node] = _start(work, cmd, node, gpus)
    _until(work, lambda r: r["world_size"] == 2, 0, "both nodes training")
    since = procs.signal_tree(agents["n1"].pid, signal.SIGKILL)
    _until(work, lambda r: r["world_size"] == 1, since, "node 0 training alone")
    agents["n1-join"], since = _start(work, cmd, "n1", gpus, suffix="-join"), time.time()
    _until(work, lambda r: r["world_size"] == 2, since, "the joiner training")
    agents["n1-join"].send_signal(signal.SIGTERM)
    _until(work, lambda r: r["world_size"] == 1, time.time(), "node 0 alone again")
    agents["n0"].send_signal(signal.SIGTERM)
    agents["n0"].wait(120)
    return ["kill n1: 2 -> 1", "join n1: 1 -> 2", "SIGTERM n1's agent: 2 -> 1", "SIGTERM n0 (the end)"]


def _start(work: Path, cmd: list[str], node: str, gpus: int, suffix: str = "") -> subprocess.Popen:
    env = procs.child_env(**{NODE_ENV: node, "NCCL_DEBUG": "INFO"})
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(int(node[1:]) % gpus)  # one GPU per node, as on two machines
    with open(work / f"{node}{suffix}.log", "wb") as log_file:
        return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=procs.die_with_parent_preexec())


def _until(work: Path, match, since: float, what: str, steps: int = 20) -> None:
    """Until node 0 trained `steps` steps after `since` that match (training goes on at the new size)."""
    procs.wait_for(lambda: sum(1 for r in read_records(str(work / "samples"))
                               if r["node"] == "n0" and r["time"] > since and match(r)) >= steps, 300, what)


def _count(work: Path) -> dict:
    """Per node: worker processes (CUDA contexts), rounds served, NCCL communicators initialised."""
    pids, rounds = defaultdict(set), defaultdict(set)
    for r in read_records(str(work / "samples")):
        pids[r["node"]].add(r["pid"])
        rounds[r["node"]].add(worker_round(r))
    comms = defaultdict(int)
    owner = {pid: node for node, ps in pids.items() for pid in ps}
    for log in work.glob("n*.log"):
        for pid in NCCL_INIT.findall(log.read_text(errors="replace")):
            comms[owner.get(int(pid), log.stem)] += 1
    return {node: {"processes": len(pids[node]), "cuda_contexts_at_most": len(pids[node]),
                   "rounds": len(rounds[node]), "nccl_communicators": comms[node]} for node in sorted(pids)}
