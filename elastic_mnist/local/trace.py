"""Replay a spot market with `elastic-mnist local --trace`: the number of running nodes follows a recorded
trace of how many spot instances a cloud kept, one trace interval every --tick seconds.

    elastic-mnist local --trace ../shared/spot-traces/aws-us-east-1f-v100-4node-2023-08.json \\
        --trace-window 2130:100 --tick 4 --notice 30 --data-dir ../shared/data --epochs 10 \\
        --min-step-time 0.3 --startup-cost 8

The trace format is SkyPilot's (`{"metadata": {"gap_seconds": 300}, "data": [4, 4, 3, 0, ...]}`). A drop
preempts nodes chosen by --trace-seed (SIGTERM, then SIGKILL --notice seconds later, or at once with
--notice 0); a preempted machine is gone with its memory (in-memory snapshots) and its own disk. A rise
starts new nodes. The run ends with the window or when training finishes; report.json then holds the
goodput accounting (local/goodput.py), also written to TensorBoard (tensorboard/goodput/).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass

from elastic_mnist.contract.errors import UserError
from elastic_mnist.local import chaos, goodput
from elastic_mnist.local.nodes import signal_groups

ON_CHANGE = ("elastic", "restart-all")


@dataclass
class Trace:
    gap_s: float
    """Real seconds between two samples of the trace."""
    counts: list[int]


def load_trace(path: str) -> Trace:
    try:
        with open(path) as f:
            doc = json.load(f)
        gap, counts = float(doc["metadata"]["gap_seconds"]), doc["data"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--trace {path}: not a readable trace ({e}); expected JSON like "
                        '{"metadata": {"gap_seconds": 300}, "data": [4, 4, 3, 0]}') from None
    if not counts or gap <= 0 or not all(isinstance(c, int) and c >= 0 for c in counts):
        raise UserError(f"--trace {path}: needs gap_seconds > 0 and a non-empty list of node counts >= 0")
    return Trace(gap, counts)


def parse_window(text: str, length: int) -> tuple[int, int]:
    """'START:COUNT' (trace intervals) -> (start, count); empty: the whole trace."""
    if not text:
        return 0, length
    try:
        start, count = (int(x) for x in text.split(":"))
    except ValueError:
        raise UserError(f"--trace-window {text!r}: expected START:COUNT, e.g. 2130:100") from None
    if start < 0 or count < 1 or start + count > length:
        raise UserError(f"--trace-window {text!r}: the trace has {length} intervals; need 0 <= START and "
                        f"1 <= COUNT with START+COUNT <= {length}")
    return start, count


def add_flags(p) -> None:
    p.add_argument("--trace", default="", help="replay this spot trace: the node count follows it (see docs/local.md)")
    p.add_argument("--tick", type=float, default=5.0, help="seconds of replay per trace interval (default 5)")
    p.add_argument("--trace-window", default="", help="START:COUNT trace intervals to replay (default: all)")
    p.add_argument("--notice", type=float, default=30.0,
                   help="seconds from a preemption's SIGTERM to its SIGKILL (0: no notice; default 30)")
    p.add_argument("--trace-seed", type=int, default=0, help="seed for which nodes a drop preempts (default 0)")
    p.add_argument("--on-change", choices=ON_CHANGE, default="elastic",
                   help="elastic (default) or restart-all: kill the whole job at every change and start it "
                        "again at the new size, as a plain checkpoint-restart script (a baseline)")


def check(args) -> None:
    """Load the window into args (trace_counts, trace_gap_s); the replay starts every node itself."""
    if args.chaos:
        raise UserError("--trace and --chaos do not mix: the trace is the fault schedule; drop one")
    if args.tick <= 0 or args.notice < 0:
        raise UserError(f"need --tick > 0 and --notice >= 0 (got {args.tick}, {args.notice})")
    tr = load_trace(args.trace)
    start, count = parse_window(args.trace_window, len(tr.counts))
    args.trace_start, args.trace_counts, args.trace_gap_s = start, tr.counts[start:start + count], tr.gap_s
    if max(args.trace_counts) > args.max_nodes or args.min_nodes != 1:
        raise UserError(f"the trace window runs up to {max(args.trace_counts)} nodes: pass --max-nodes >= that "
                        f"(got {args.max_nodes}) and keep --min-nodes 1 (got {args.min_nodes})")
    args.nodes = 0


class Replay:
    """Drives the launcher's nodes from the trace; its tick() runs in the launcher's poll loop."""

    def __init__(self, launcher):
        self.l, self.args = launcher, launcher.args
        self.rng = random.Random(self.args.trace_seed)
        self.t0: float | None = None
        self.index = -1
        self.timeline: list[tuple[float, int]] = []
        """(when, node count) at every applied trace interval."""
        self.live: list = []
        """The nodes the trace counts as running."""
        self.kills: list[tuple[float, object]] = []
        """(when, node): preempted nodes whose notice runs out then."""
        self.window_done = False
        self.ended_at: float | None = None

    def tick(self, now: float) -> None:
        if self.t0 is None:
            self.t0 = now
        for due, node in [k for k in self.kills if k[0] <= now]:
            self.kills.remove((due, node))
            self._gone(node)
        due = min(int((now - self.t0) / self.args.tick), len(self.args.trace_counts) - 1)
        while self.index < due:
            self.index += 1
            self._apply(self.args.trace_counts[self.index], now)
        if now - self.t0 >= len(self.args.trace_counts) * self.args.tick:
            self.window_done, self.ended_at = True, now
            self.l.view.event(f"trace window over ({len(self.args.trace_counts)} intervals): stopping")

    def over(self) -> bool:
        nodes = self.l.nodes.values()
        finished = self.l._job_done() and all(n.exited_at is not None and n.restart_at is None for n in nodes)
        if finished and self.ended_at is None:
            self.ended_at = time.time()
        return self.window_done or finished

    def _event(self, kind: str, node: str | None, now: float) -> chaos.Event:
        event = chaos.Event(kind, node, max(self.l.tail.latest_step, 0), now, self.l.tail.world_size)
        event.notes.append(f"trace interval {self.args.trace_start + self.index}: {self._count()} -> "
                           f"{self.args.trace_counts[self.index]} nodes")
        self.l.events.append(event)
        self.l.view.event(f"{kind} {node or ''} ({event.notes[-1]}; step {event.at_step})")
        return event

    def _count(self) -> int:
        return self.timeline[-1][1] if self.timeline else 0

    def _apply(self, target: int, now: float) -> None:
        if target == self._count() and self.timeline:
            return
        if self.args.on_change == "restart-all":
            self._restart_all(target, now)
        else:
            for node in self.rng.sample(self.live, max(0, len(self.live) - target)):
                self._preempt(node, now)
            for _ in range(target - len(self.live)):
                self.live.append(self.l.start_node())
                self._event("join", self.live[-1].name, now)
        self.timeline.append((now, target))

    def _preempt(self, node, now: float) -> None:
        self.live.remove(node)
        node.injected = True  # the launcher must not restart a machine the market took back
        self._event("preempt", node.name, now)
        if self.args.notice > 0:
            node.term_agent()
            self.kills.append((now + self.args.notice, node))
        else:
            self._gone(node)

    def _gone(self, node) -> None:
        """The machine is gone: every process at once, and its memory and own disk with it."""
        node.signal_all(signal.SIGKILL)
        self._clean_up(node)

    def _clean_up(self, node) -> None:
        node.shutdown(grace_s=0)
        own = self.l.node_config(node.name)
        if "snapshot_dir" not in self.l.given:
            shutil.rmtree(own.snapshot_dir, ignore_errors=True)
        if own.checkpoint_storage == "local" and "checkpoint_dir" not in self.l.given:
            shutil.rmtree(own.checkpoint_dir, ignore_errors=True)

    def _restart_all(self, target: int, now: float) -> None:
        """The baseline: every change kills the whole job; it starts again at the new size (a static
        torchrun job, a fresh rendezvous) from its last periodic checkpoint."""
        # Every node's processes die before any is reaped: killed one by one, the survivors would see the
        # lost peer and save their last step (this runtime's failure path), which a plain script never does.
        gone, self.live = self.live, []
        for node in gone:
            node.injected = True
        signal_groups(set().union(*(node.groups() for node in gone)), signal.SIGKILL)
        for node in gone:
            self._clean_up(node)
        self._event("restart-all", None, now)
        if target:
            self.l.run_id = f"local-{os.getpid()}-{int(now * 1000)}"
            self.args.min_nodes = self.args.max_nodes = target
            self.live = [self.l.start_node() for _ in range(target)]

    def report(self) -> dict:
        """The replay's settings and timeline, and the goodput accounting (also to TensorBoard)."""
        end = self.ended_at or time.time()
        tail, cfg = self.l.tail, self.l.config
        acc = goodput.account(goodput.Run(
            timeline=self.timeline, end=end, processes=tail.processes, journal=tail.journal,
            events=chaos.to_json(self.l.events), batch=cfg.global_batch_size, per_node=self.args.nproc_per_node,
            tick_s=self.args.tick, gap_s=self.args.trace_gap_s,
            ticks=self.args.trace_counts[:self.index + 1]), cfg.startup_cost)
        goodput.write_tensorboard(os.path.join(cfg.log_dir, "goodput"), acc)
        print("\n" + goodput.summary_text(acc), flush=True)
        a = self.args
        return {"trace": {"file": os.path.abspath(a.trace), "window": [a.trace_start, len(a.trace_counts)],
                          "tick_s": a.tick, "gap_s": a.trace_gap_s, "notice_s": a.notice, "seed": a.trace_seed,
                          "on_change": a.on_change, "counts": a.trace_counts, "window_done": self.window_done,
                          "timeline": [[round(t - self.t0, 3), c] for t, c in self.timeline] if self.t0 else []},
                "profile": {"min_step_time_s": cfg.min_step_time, "startup_cost_s": cfg.startup_cost,
                            "global_batch_size": cfg.global_batch_size},
                "goodput": acc}
