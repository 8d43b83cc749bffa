"""Simulated nodes for the local launcher: each one a real `torchrun` agent in its own session, with
its log, pid and process-group id in the run dir so outside tools can inject faults too.

    elastic-mnist local --nodes 2        # starts Node('n0'), Node('n1') through this module
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from elastic_mnist.procs import alive, descendants, die_with_parent_preexec

STOP_GRACE_S = 40.0  # an agent asked to stop: how long it has to stop its workers before the node is killed

# An agent that exits on its own is started again after 1 s, then 2, 4, ... up to 16 s: a kubelet's
# CrashLoopBackOff, shortened for one machine (an etcd that is down for a while is not hammered).
RESTART_BACKOFF_S, RESTART_BACKOFF_CAP_S = 1.0, 16.0


def restart_delay(restarts: int) -> float:
    """Seconds to wait before restarting an agent that was restarted `restarts` times before."""
    return min(RESTART_BACKOFF_CAP_S, RESTART_BACKOFF_S * 2 ** restarts)


@dataclass
class Node:
    name: str
    command: list[str]
    env: dict
    run_dir: str
    proc: subprocess.Popen | None = None
    seen_pids: set = field(default_factory=set)
    """Every pid this node's process tree ever had (agent and workers): the orphan check's list."""
    exited_at: float | None = None
    injected: bool = False
    """The agent's exit was caused by an injected fault (kill, term): such a node stays down."""
    restarts: int = 0
    """How often the launcher restarted this node's agent after it exited on its own."""
    restart_at: float | None = None
    """When a pending restart is due (after the back-off)."""

    def start(self) -> None:
        os.makedirs(os.path.join(self.run_dir, "nodes"), exist_ok=True)
        log = open(self.log_path, "ab")
        # Own session: the node's torchrun agent and everything it starts can be signalled as a unit.
        # If the launcher itself is killed, its nodes die with it rather than train on unsupervised.
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, preexec_fn=die_with_parent_preexec())
        log.close()
        self.seen_pids.add(self.proc.pid)
        info = {"name": self.name, "pid": self.proc.pid, "pgid": os.getpgid(self.proc.pid), "log": self.log_path}
        with open(os.path.join(self.run_dir, "nodes", f"{self.name}.json"), "w") as f:
            json.dump(info, f)
        with open(os.path.join(self.run_dir, "nodes", f"{self.name}.pid"), "w") as f:
            f.write(f"{self.proc.pid}\n")

    def restart(self) -> None:
        """A new agent on the same machine: same name, log (appended), memory and disk, same job id."""
        self.exited_at = self.restart_at = None
        self.restarts += 1
        self.start()

    @property
    def log_path(self) -> str:
        return os.path.join(self.run_dir, "nodes", f"{self.name}.log")

    def tree(self, pids: dict[int, list[int]] | None = None) -> list[int]:
        """The agent and its live descendants (workers run in sessions of their own); `pids`: a
        `procs.children()` read once for every node."""
        if self.proc is None:
            return []
        out = descendants(self.proc.pid, pids)
        self.seen_pids.update(out)
        return out

    def signal_all(self, sig: int) -> None:
        """Signal every process group in the node's tree: the whole machine crashes or freezes."""
        signal_groups(self.groups(), sig)

    def groups(self) -> set[int]:
        """The process groups of the node's tree (the agent's session and each worker's)."""
        return {os.getpgid(pid) for pid in self.tree() if _safe_pgid(pid)}

    def term_agent(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGTERM)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def ask_to_stop(self) -> None:
        """SIGTERM the agent (it forwards to its workers and waits for them)."""
        if self.running:
            self.tree()
            self.signal_all(signal.SIGCONT)  # a stopped node cannot handle SIGTERM
            self.term_agent()

    def shutdown(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the agent, then SIGKILL what is left after `grace_s`."""
        self.ask_to_stop()
        self.finish_stop(grace_s)

    def finish_stop(self, grace_s: float) -> None:
        """Wait up to `grace_s` for an agent asked to stop, then SIGKILL what is left of the node."""
        if self.running:
            try:
                self.proc.wait(timeout=max(0.0, grace_s))
            except subprocess.TimeoutExpired:
                pass
        self.signal_all(signal.SIGKILL)
        for pid in self.seen_pids:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.proc is not None:
            self.proc.wait()


def signal_groups(pgids: set[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass


def _safe_pgid(pid: int) -> bool:
    try:
        os.getpgid(pid)
        return True
    except ProcessLookupError:
        return False


def shutdown_all(nodes: Iterable[Node], grace_s: float = STOP_GRACE_S) -> None:
    """Stop every node at once, as a job's end stops all its pods: asked one by one, the nodes still running
    would see the others leave and form smaller rounds among themselves until their own turn came."""
    nodes = list(nodes)
    for node in nodes:
        node.ask_to_stop()
    deadline = time.monotonic() + grace_s
    for node in nodes:
        node.finish_stop(deadline - time.monotonic())
