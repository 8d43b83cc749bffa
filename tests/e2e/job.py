"""A few torchrun nodes of one elastic job, started as real processes against a real etcd: what the
parent-death and peer-loss tests drive directly (the chaos tests go through `elastic-mnist local`)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter

from elastic_mnist import procs
from elastic_mnist.contract import torchrun as torchrun_settings
from elastic_mnist.runlog import read_records
from elastic_mnist.state import fence
from elastic_mnist.state import format as checkpoint


class Job:
    """`start()` again is what a kubelet does after a crash: same id, same flags."""

    def __init__(self, tmp_path, data_dir: str, endpoint: str, backend: str, max_steps: int, *extra: str,
                 nodes: int = 2, min_nodes: int = 2, env: dict | None = None,
                 max_restarts: int = torchrun_settings.MAX_RESTARTS):
        self.tmp, self.endpoint, self.backend, self.max_steps = tmp_path, endpoint, backend, max_steps
        self.nodes, self.min_nodes, self.env, self.max_restarts = nodes, min_nodes, env or {}, max_restarts
        self.run_id = f"job-{os.getpid()}-{tmp_path.name}"[:60]
        self.train_args = [
            f"--data-dir={data_dir}", f"--checkpoint-dir={tmp_path / 'ckpt'}", f"--log-dir={tmp_path / 'runs'}",
            f"--sample-log={tmp_path / 'samples'}", f"--max-steps={max_steps}", "--checkpoint-every=0",
            "--snapshot-every=0", "--min-step-time=0.1", "--log-every=10", "--collective-timeout=60", *extra]
        self.agents: list[subprocess.Popen] = []
        self.node_env: dict[int, dict] = {}  # node index -> extra environment of its process tree only
        self.node_args: dict[int, list[str]] = {}  # node index -> its workers' own flags (after the others: they win)

    def start(self) -> None:
        for i in range(self.nodes):
            self.start_node(i)

    def start_node(self, i: int) -> subprocess.Popen:
        """Node i's agent (again: a kubelet's restart, or a replacement machine under that name)."""
        targs = torchrun_settings.torchrun_args(self.backend, self.endpoint, self.run_id, self.min_nodes, self.nodes,
                                                max_restarts=self.max_restarts)
        log = open(self.tmp / f"node{i}-{len(self.agents)}.log", "wb")
        argv = self.command(i, procs.torchrun_command(targs, self.train_args + self.node_args.get(i, [])))
        self.agents.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            env=procs.child_env(**self.env, **self.node_env.get(i, {})),
                                            start_new_session=True, preexec_fn=procs.die_with_parent_preexec()))
        log.close()
        return self.agents[-1]

    def command(self, node: int, argv: list[str]) -> list[str]:
        """How node `node`'s agent is started: here, on this machine."""
        return argv

    def latest_step(self) -> int:
        return max((r["step"] for r in read_records(str(self.tmp / "samples"))), default=-1)

    def events(self, kind: str) -> list[dict]:
        return [e for e in read_records(str(self.tmp / "runs" / "events")) if e["event"] == kind]

    def workers(self) -> list[int]:
        return [pid for a in self.agents[-self.nodes:] for pid in procs.descendants(a.pid) if pid != a.pid]

    def newest_checkpoint_step(self) -> int:
        found = checkpoint.list_checkpoints(str(self.tmp / "ckpt"))
        return found[0][0] if found else -1

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(self.tmp.glob("node*.log")))

    def finish(self, timeout: float = 300) -> None:
        for a in self.agents[-self.nodes:]:
            assert a.wait(timeout=timeout) == 0, self.logs()
        assert fence.read_finished(str(self.tmp / "ckpt"))["step"] == self.max_steps

    def redone_steps(self) -> int:
        """Steps that rank 0 trained more than once (one record per step per worker process)."""
        counts = Counter(r["step"] for r in read_records(str(self.tmp / "samples")) if r["rank"] == 0)
        assert sorted(counts) == list(range(self.max_steps)), "every step of the plan was trained"
        return sum(n - 1 for n in counts.values())

    def kill_all(self) -> None:
        for a in self.agents:
            procs.signal_tree(a.pid, signal.SIGKILL)
            a.wait()


class HostJob(Job):
    """A Job whose node i runs on host `n{i}` of `hosts` (tests/netns.py's fixture; made on first start), e.g.
    `HostJob(hosts, tmp_path, data, etcd_host.endpoint, "etcd-v3", 60)`, then `hosts.cut("n0", "n1")`."""

    def __init__(self, hosts, *args, **kw):
        super().__init__(*args, **kw)
        self.hosts = hosts

    def command(self, node: int, argv: list[str]) -> list[str]:
        name = f"n{node}"
        if name not in self.hosts.hosts:
            self.hosts.add(name)
        return self.hosts.command(name, argv)
