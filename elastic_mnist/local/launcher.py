"""`elastic-mnist local`: an embedded etcd plus N real torchrun nodes on this machine, with faults.

    elastic-mnist local --nodes 2 --max-nodes 3 --chaos 'kill:n1@step=150,join@step=300,term:n0@step=450' \\
        --data-dir ../shared/data --epochs 2

Writes into --run-dir: nodes/NAME.{log,pid,json}, etcd/ (its data), tensorboard/ (with the workers' event
journal in tensorboard/events/), checkpoints/, samples/ (the per-rank sample logs the report is computed
from) and report.json; docs/local.md has the details. Ctrl-C or SIGTERM stops everything (nodes,
workers, etcd) and exits non-zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import time

from elastic_mnist import files
from elastic_mnist.config import TrainConfig
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract import torchrun as torchrun_settings
from elastic_mnist.contract.env import NODE_ENV
from elastic_mnist.contract.errors import UserError
from elastic_mnist.local import chaos, hosts, trace
from elastic_mnist.local.flags import RUN_DIR_MARK, parse
from elastic_mnist.local.live import STUCK_S, LiveView, read_rendezvous, stuck_line
from elastic_mnist.local.nodes import Node, restart_delay, shutdown_all
from elastic_mnist.procs import alive, child_env, children, torchrun_command
from elastic_mnist.runlog import RunTail
from elastic_mnist.state import snapshots

POLL_S = 0.1


class Launcher:
    def __init__(self, args, config: TrainConfig, given: set[str], faults: list[chaos.Fault]):
        self.args, self.config, self.given, self.faults = args, config, given, faults
        self.run_id = f"local-{os.getpid()}-{int(time.time())}"  # a closed rendezvous id cannot be reused
        os.makedirs(args.run_dir, exist_ok=True)  # checked by parse(): new, empty or a launcher's own
        files.atomic_write(os.path.join(args.run_dir, RUN_DIR_MARK), "an elastic-mnist local run dir\n")
        self.nodes: dict[str, Node] = {}
        self.events: list[chaos.Event] = []
        self.tail = RunTail(config.sample_log, config.log_dir)
        self.view = LiveView()
        self.etcd = None
        self.config_error: str | None = None  # the line a configuration error ended the job with
        self.hosts: hosts.LauncherHosts | None = None  # --hosts: set for the run by hosts.for_launcher
        self.rdzv_endpoint = ""
        self.replay = trace.Replay(self) if args.trace else None
        self.t0 = time.time()
        self.stuck_said: dict[int, int] = {}  # id(event) -> how many STUCK_S periods were reported
        self.nodes_started_at = self.t0
        # Each simulated node's "RAM" for snapshots; removed at the end like a machine's memory.
        shm = snapshots.root_of(TrainConfig().snapshot_dir) or os.path.join(args.run_dir, "shm")
        self.shm_root = os.path.join(shm, f"local-{snapshots.run_name(self.run_id)}")

    def start_node(self) -> Node:
        name = f"n{len(self.nodes)}"
        targs = torchrun_settings.torchrun_args(self.args.rdzv_backend, self.rdzv_endpoint, self.run_id,
                                                self.args.min_nodes, self.args.max_nodes, self.args.nproc_per_node,
                                                self.args.rdzv_conf_items)
        # torchrun's rendezvous decisions (INFO) go to the node logs unless the user chose a level.
        env = child_env(LOGLEVEL=os.environ.get("LOGLEVEL", "INFO"), **{NODE_ENV: name})
        command = torchrun_command(targs, self.node_config(name).to_argv(), script=self.args.script)
        if self.hosts:
            command = self.hosts.wrap(name, command)
        node = Node(name, command, env, self.args.run_dir)
        node.start()
        self.nodes[name] = node
        return node

    def node_config(self, name: str) -> TrainConfig:
        """What differs between simulated machines: their memory (snapshots) and, with node-local
        storage, their disks; a directory the user set is shared by every node."""
        own = {}
        if "snapshot_dir" not in self.given:
            own["snapshot_dir"] = os.path.join(self.shm_root, name)
        if self.config.checkpoint_storage == "local" and "checkpoint_dir" not in self.given:
            own["checkpoint_dir"] = os.path.join(self.args.run_dir, "nodes", name, "checkpoints")
        return dataclasses.replace(self.config, **own)

    def _resolve(self, name: str):
        """A node by name, or `rank0`: the node whose process tree runs the newest rank-0 worker."""
        if name != "rank0":
            return self.nodes.get(name)
        newest = self.tail.newest(rank=0)
        if newest is None:
            return None
        return next((n for n in self.nodes.values() if newest["pid"] in n.tree()), None)

    def fire(self, fault: chaos.Fault) -> None:
        fault.fired, fault.fired_at = True, time.time()
        event = chaos.Event(fault.kind, fault.node, max(self.tail.latest_step, 0), time.time(), self.tail.world_size)
        node = self._resolve(fault.node) if fault.node else None
        if node is not None:
            event.node = node.name
            if fault.kind == "stop":  # its +cont resumes this very node, wherever rank 0 is by then
                later = next((f for f in self.faults if f.kind == "cont" and f.node == fault.node and not f.fired),
                             None)
                if later is not None:
                    later.node = node.name
        if fault.node and node is None:
            event.notes.append(f"no node {fault.node}")
        elif fault.kind == "kill":
            node.injected = True  # the agent's exit is this fault's doing: the node stays down
            node.signal_all(signal.SIGKILL)
        elif fault.kind == "term":
            node.injected = True
            node.term_agent()
        elif fault.kind in ("stop", "cont"):
            node.signal_all(signal.SIGSTOP if fault.kind == "stop" else signal.SIGCONT)
        elif fault.kind == "join":
            event.node = self.start_node().name
        elif fault.kind == "etcd-restart":
            self.etcd.restart()
        elif fault.kind in chaos.HOST_KINDS:
            event.node = self.hosts.fire(fault, node) or None
        self.events.append(event)
        self.view.event(f"{fault.kind} {event.node or ''} at step {event.at_step} (world {event.world_size_before})")

    def loop(self) -> None:
        while True:
            self.view.show(self.tail.poll_events())
            # Remember worker pids for the orphan check: one read of /proc for all nodes, ten times a second,
            # on the cores the job trains and recovers on.
            pids = children()
            for node in list(self.nodes.values()):
                node.tree(pids)
                self.supervise(node, time.time())
            # From what supervise() saw, not a fresh poll: a node that exits right now is noted next round.
            if self.replay.over() if self.replay else all(
                    n.exited_at is not None and n.restart_at is None for n in self.nodes.values()):
                break
            if self.args.timeout and time.time() - self.t0 > self.args.timeout:
                self.view.event(f"timeout after {self.args.timeout:.0f}s: stopping")
                break
            if self.args.end_after_chaos and self._chaos_over():
                self.view.event("every fault fired and the job recovered from the last: stopping")
                break
            self.replay.tick(time.time()) if self.replay else self._fire_next()
            time.sleep(POLL_S)

    def supervise(self, node: Node, now: float) -> None:
        """Note an agent's exit, and restart one that exited on its own with an error once its back-off
        is over, as a kubelet restarts a container. Exit 0 means the node is done; a node an injected
        kill or term ended stays down; nothing restarts once the job is done."""
        if node.exited_at is None and not node.running:
            node.exited_at = now
            self.view.event(f"{node.name} exited with code {node.returncode}")
            # 78: a configuration error ended the job (the agent said why); a restart would meet it again
            if self.args.restart and not node.injected and node.returncode not in (0, exit_codes.PERMANENT):
                node.restart_at = now + restart_delay(node.restarts)
                self.events.append(chaos.Event("agent-restart", node.name, max(self.tail.latest_step, 0), now,
                                               self.tail.world_size, exit_code=node.returncode))
        if node.restart_at is not None and now >= node.restart_at:
            if node.injected or self._job_done():  # killed while waiting, or nothing left to do
                node.restart_at = None
                return
            node.restart()
            self.view.event(f"{node.name} restarted (restart {node.restarts}, agent pid {node.proc.pid})")

    def _job_done(self) -> bool:
        """A node whose agent ended cleanly by itself: its workers finished the job."""
        return any(n.returncode == 0 and not n.injected for n in self.nodes.values())

    def _chaos_over(self) -> bool:
        """Every scheduled fault fired, and the job trained a step at its new size after the last one."""
        if not self.faults or not all(f.fired for f in self.faults):
            return False
        last = [e for e in self.events if e.kind in chaos.KINDS][-1]
        chaos.account(last, self.tail.processes)
        return last.recovery_s is not None

    def _fire_next(self) -> None:
        """Faults fire in schedule order, each once the job has recovered from the previous one, so
        every fault's recovery and lost work are measured on their own."""
        pending = [f for f in self.faults if not f.fired]
        if not pending or not pending[0].due(self.tail.latest_step, time.time() - self.t0):
            return
        faults = [e for e in self.events if e.kind in chaos.KINDS]  # not the launcher's own agent-restarts
        if faults and faults[-1].kind != "etcd-restart" and pending[0].trigger != "after":
            chaos.account(faults[-1], self.tail.processes)
            if faults[-1].recovery_s is None:
                self._say_stuck(faults[-1])
                return
        self.fire(pending[0])

    def _say_stuck(self, event: chaos.Event) -> None:
        periods = int((time.time() - event.time) // STUCK_S)
        if periods > self.stuck_said.get(id(event), 0):
            self.stuck_said[id(event)] = periods
            node = self.nodes.get(event.node or "")
            self.view.event(stuck_line(event.kind, event.node, time.time() - event.time, self.tail.world_size,
                                       self._rdzv_status(), {n.proc.pid: n.name for n in self.nodes.values()},
                                       node.log_path if node else None))

    def run(self) -> int:
        with hosts.for_launcher(self):  # --hosts: etcd and each node on a host of its own, all removed after
            return self._run()

    def _run(self) -> int:
        from elastic_mnist.etcd.server import EtcdServer, free_port

        self.view.event(f"run dir {self.args.run_dir}")
        server = self.hosts.etcd if self.hosts else EtcdServer
        self.etcd = server(data_dir=os.path.join(self.args.run_dir, "etcd"), binary=self.args.etcd_binary,
                         enable_v2=self.args.rdzv_backend == "etcd",
                         log_path=os.path.join(self.args.run_dir, "etcd.log")).start()
        with open(os.path.join(self.args.run_dir, "etcd.pid"), "w") as f:
            f.write(f"{self.etcd.pid}\n")
        with open(os.path.join(self.args.run_dir, "etcd.json"), "w") as f:
            json.dump({"endpoint": self.etcd.endpoint, "pid": self.etcd.pid, "v2_api": self.etcd.enable_v2,
                       "rdzv_id": self.run_id, "rdzv_backend": self.args.rdzv_backend}, f)
        self.view.event(f"etcd {self.etcd.endpoint} (pid {self.etcd.pid}); rendezvous id {self.run_id}")
        # c10d keeps its store in the first agent that binds this port, not in etcd.
        self.rdzv_endpoint = f"127.0.0.1:{free_port()}" if self.args.rdzv_backend == "c10d" else self.etcd.endpoint
        try:
            self.nodes_started_at = time.time()
            for _ in range(self.args.nodes):
                self.start_node()
            self.loop()
        finally:
            shutdown_all(self.nodes.values())
            self.config_error = self._config_error()  # read while etcd still runs
            self.etcd.close()
            shutil.rmtree(self.shm_root, ignore_errors=True)
            with contextlib.suppress(OSError):  # the per-user root too, unless another run still keeps state there
                os.rmdir(os.path.dirname(self.shm_root))
        return self.report()

    def _ended_on_config_error(self) -> bool:
        return any(n.returncode == exit_codes.PERMANENT for n in self.nodes.values())

    def _config_error(self) -> str | None:
        """The worker's own line a configuration error closed the job with (etcd-v3 keeps it in the job's store)."""
        status = self._rdzv_status() if self._ended_on_config_error() else None
        return status.get("config_error") if status else None

    def _rdzv_status(self) -> dict | None:
        # not readable from here with another backend, nor with --hosts (etcd is on a host of its own)
        ok = self.args.rdzv_backend == "etcd-v3" and not self.hosts
        return read_rendezvous(self.etcd.endpoint, self.run_id, self.args.rdzv_conf_items) if ok else None

    def _cold_start_s(self) -> float | None:
        """Launch of the first nodes to the job's first completed step: what a recovery is compared to."""
        firsts = [recs[0]["time"] for recs in self.tail.processes.values()]
        return round(min(firsts) - self.nodes_started_at, 3) if firsts else None

    def report(self) -> int:
        self.view.show(self.tail.poll_events())
        for event in self.events:
            chaos.account(event, self.tail.processes, self.tail.journal)
        orphans = sorted(pid for n in self.nodes.values() for pid in n.seen_pids if alive(pid))
        summary_path = os.path.join(self.config.log_dir, "summary.json")
        summary = json.load(open(summary_path)) if os.path.exists(summary_path) else None
        report = {"events": chaos.to_json(self.events), "summary": summary, "orphans": orphans,
                  "nodes": {n.name: {"pid": n.proc.pid, "exit_code": n.returncode, "exited_at": n.exited_at,
                                     "restarts": n.restarts}
                            for n in self.nodes.values()},
                  "run_id": self.run_id, "wall_s": round(time.time() - self.t0, 2), "chaos": self.args.chaos,
                  "cold_start_s": self._cold_start_s(), "evals": [e for e in self.tail.journal if e["event"] == "eval"],
                  "launched_at": self.t0, **(self.replay.report() if self.replay else {})}
        with open(os.path.join(self.args.run_dir, "report.json"), "w") as f:
            json.dump(report, f, indent=2)
        print("\n" + chaos.events_table(self.events), flush=True)
        done = summary is not None and summary["global_step"] == summary["total_steps"]
        done = done or (self.replay is not None and self.replay.window_done)  # trained through the window
        if summary:
            print(f"\nfinal: step {summary['global_step']}/{summary['total_steps']}, test accuracy "
                  f"{summary['test_accuracy']:.4f}, world {summary['world_size']}; orphans {orphans or 'none'}")
        print(f"report: {os.path.join(self.args.run_dir, 'report.json')}", flush=True)
        if not done and self._ended_on_config_error():
            line = self.config_error or f"its line is in the node logs under {self.args.run_dir}/nodes"
            print(f"elastic-mnist local: error: the job ended on a configuration error: {line}; fix it and run again",
                  file=sys.stderr, flush=True)
            return exit_codes.PERMANENT
        return 0 if done and not orphans else 1


def main(argv: list[str] | None = None) -> int:
    try:
        launcher = Launcher(*parse(list(sys.argv[1:] if argv is None else argv)))
    except UserError as e:  # a bad flag: nothing started, and no restart of anything can help
        print(f"elastic-mnist local: error: {e}", file=sys.stderr, flush=True)
        return exit_codes.PERMANENT

    def on_signal(signum, _frame):
        raise KeyboardInterrupt  # unwinds through run()'s finally: nodes and etcd are stopped

    signal.signal(signal.SIGTERM, on_signal)
    try:
        return launcher.run()
    except KeyboardInterrupt:
        print("elastic-mnist local: interrupted; nodes and etcd stopped", file=sys.stderr, flush=True)
        return exit_codes.INTERRUPTED
