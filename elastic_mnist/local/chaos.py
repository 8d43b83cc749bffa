"""Fault schedules for `elastic-mnist local --chaos`, and the accounting of what each fault cost.

    elastic-mnist local --nodes 2 --chaos 'kill:n1@step=150,join@step=300,term:n0@step=450'

Syntax: comma-separated `KIND[:NODE]@TRIGGER[+cont@TRIGGER]`, TRIGGER = `step=N` (global step) or
`time=Ns` (seconds since launch); NODE is a name (n0, n1, ...) or `rank0`, whichever node holds global
rank 0 when the fault fires. Kinds: kill (SIGKILL the node's processes: a crashed machine),
term (SIGTERM to the node's torchrun agent: a spot preemption notice), stop (SIGSTOP: a frozen machine;
`+cont@...` resumes it), cont, join (start a new node), etcd-restart (stop and restart etcd, same data).
With `--hosts` (each node on a host of its own, local/hosts.py): vanish (the node's link goes down, then its
processes die: a VM reclaimed), down (its link down, its processes live on: a blip until `heal`),
cut:A-B (A and B lose each other's packets, silently; `A>B`: only A's packets to B; B may be `etcd`),
heal (every cut undone, every link up). TRIGGER `after=Ns`: N seconds after the previous fault fired,
whether or not the job has recovered from it (`down:n1@step=30,heal@after=4s` is a 4 s blip).
The report also lists `agent-restart` events: the launcher restarting an agent that exited on its own.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field

from elastic_mnist.contract.errors import UserError
from elastic_mnist.runlog import worker_round

HOST_KINDS = ("vanish", "down", "cut", "heal")
"""Faults of the network between hosts: only with --hosts."""
KINDS = ("kill", "term", "stop", "cont", "join", "etcd-restart", *HOST_KINDS)
NODELESS = ("join", "etcd-restart", "heal")
_ITEM = re.compile(r"^(?P<kind>[a-z-]+)(?::(?P<node>n\d+|rank0)(?:(?P<way>[->])(?P<peer>n\d+|etcd))?)?"
                   r"@(?P<trigger>step=\d+|(?:time|after)=\d+(?:\.\d+)?s?)$")


@dataclass
class Fault:
    kind: str
    node: str | None
    trigger: str
    """'step', 'time' (since launch) or 'after' (seconds after the previous fault fired)."""
    value: float
    fired: bool = False
    peer: str | None = None
    """cut only: the other end (a node or `etcd`)."""
    both: bool = True
    """cut only: False drops only node's packets to peer (`A>B`)."""
    fired_at: float | None = None
    previous: Fault | None = field(default=None, repr=False)
    """The fault before this one in the schedule: what an `after=` trigger counts from."""

    def due(self, step: int, elapsed_s: float) -> bool:
        if self.fired:
            return False
        if self.trigger == "after":
            return self.previous is None or (self.previous.fired_at is not None and
                                             time.time() - self.previous.fired_at >= self.value)
        return step >= self.value if self.trigger == "step" else elapsed_s >= self.value


def _parse_item(item: str) -> Fault:
    m = _ITEM.match(item.strip())
    if not m or m["kind"] not in KINDS:
        raise UserError(f"bad --chaos item {item!r}: expected KIND[:NODE]@step=N, @time=Ns or @after=Ns with KIND "
                        f"one of {', '.join(KINDS)} (e.g. kill:n1@step=200,join@time=30s)")
    if (m["node"] is None) != (m["kind"] in NODELESS):
        need = "takes no node" if m["kind"] in NODELESS else "needs a node, e.g. kill:n1@step=200"
        raise UserError(f"bad --chaos item {item!r}: {m['kind']} {need}")
    if (m["peer"] is None) != (m["kind"] != "cut"):
        need = "needs two ends, e.g. cut:n0-n1 or cut:n1-etcd" if m["kind"] == "cut" else "takes one node"
        raise UserError(f"bad --chaos item {item!r}: {m['kind']} {need}")
    trigger, value = m["trigger"].split("=")
    return Fault(m["kind"], m["node"], trigger, float(value.rstrip("s")), peer=m["peer"], both=m["way"] != ">")


def parse_schedule(text: str, hosts: bool = False) -> list[Fault]:
    """The faults in schedule order; host faults (HOST_KINDS) only when each node has a host (--hosts)."""
    faults = parse_items(text)
    for fault, previous in zip(faults[1:], faults):
        fault.previous = previous
    needs_hosts = sorted({f.kind for f in faults if f.kind in HOST_KINDS})
    if needs_hosts and not hosts:
        raise UserError(f"--chaos {', '.join(needs_hosts)} need each node on a host of its own: add --hosts "
                        "(root only)")
    return faults


def parse_items(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        head, *conts = item.split("+")
        fault = _parse_item(head)
        faults.append(fault)
        for cont in conts:
            if fault.kind != "stop" or not cont.startswith("cont@"):
                raise UserError(f"bad --chaos item {item!r}: only stop takes '+cont@TRIGGER'")
            faults.append(_parse_item(f"cont:{fault.node}@{cont[len('cont@'):]}"))
    return faults


@dataclass
class Event:
    kind: str
    node: str | None
    at_step: int
    time: float
    world_size_before: int
    world_size_after: int | None = None
    recovery_s: float | None = None
    stall_s: float | None = None
    """From the last step trained before the change to the first at the new size (what the job waited)."""
    steps_redone: int | None = None
    breakdown: dict | None = None
    notes: list = field(default_factory=list)
    exit_code: int | None = None
    """agent-restart only: the code the agent exited with (negative: killed by that signal)."""


def account(event: Event, processes: dict, journal: list[dict] | None = None) -> None:
    """Fill recovery_s, stall_s and steps_redone from the sample records of each worker round ((pid, round) ->
    records, as runlog.RunTail.processes holds them: a fresh process serves one round, a kept one several).

    Recovery: from the fault to the first step completed by a round that started after it. Stall: from the
    last step any earlier round completed before that to the same first step (what the job waited; for a
    join the running nodes train on while the joiner prepares). Steps redone: steps completed before the
    fault that the new rounds computed again.
    """
    new_rounds = [recs for recs in processes.values() if recs and recs[0]["time"] > event.time]
    old_rounds = [recs for recs in processes.values() if recs and recs[0]["time"] <= event.time]
    # No membership change expected (or, after a blip or heal, none happened): the same workers go on.
    if event.kind == "etcd-restart" or (event.kind in ("down", "heal") and not new_rounds):
        later = [r for recs in old_rounds for r in recs if r["time"] > event.time]
        if later:
            first = min(later, key=lambda r: r["time"])
            event.world_size_after, event.steps_redone = first["world_size"], 0
            event.recovery_s = event.stall_s = round(first["time"] - event.time, 3)
            return
    # A round at the size this fault makes: one that a change just before it formed (a join fired while a
    # preemption's round still forms) is not its recovery, and the next fault would fire on it.
    grow = {"join": 1, "kill": -1, "term": -1, "vanish": -1}.get(event.kind, 0)
    new_rounds = [recs for recs in new_rounds if (recs[0]["world_size"] - event.world_size_before) * grow >= 0
                  and (not grow or recs[0]["world_size"] != event.world_size_before)]
    if not new_rounds:
        return
    first = min((recs[0] for recs in new_rounds), key=lambda r: r["time"])
    done_before = [r for recs in old_rounds for r in recs if r["time"] <= first["time"]]
    first_new_step = min(r["step"] for recs in new_rounds for r in recs)
    last_old = max((r["time"] for r in done_before), default=event.time)
    event.world_size_after = first["world_size"]
    event.recovery_s = round(first["time"] - event.time, 3)
    event.stall_s = round(first["time"] - last_old, 3)
    event.steps_redone = max(0, max((r["step"] for r in done_before), default=-1) - first_new_step + 1)
    event.breakdown = breakdown(event, first, journal or [])


def breakdown(event: Event, first: dict, journal: list[dict]) -> dict | None:
    """Where the recovery went: detection (fault → the old workers stop), rendezvous (→ torchrun starts the
    round's process: a fresh worker, or the stand-in of a kept one), attach (→ the worker takes the round: a
    fresh one imports, pays its start-up and builds first; a kept one has all that), process group, state (the
    agreement, a transfer, a load: nothing for a kept worker whose memory won), first step."""
    after = sorted((e for e in journal if e["time"] > event.time), key=lambda e: e["time"])
    start = next((e for e in after if e["event"] == "startup" and worker_round(e) == worker_round(first)), None)
    if start is None:
        return None
    p = start["phases"]
    began = p.get("process_start") or p["stand_in"]
    stopped = next((e["time"] for e in after if e["event"] in ("collective_failed", "stop", "peer_lost")), None)
    detected = stopped if stopped is not None and stopped < began else began
    parts = {"detection_s": detected - event.time, "rendezvous_s": began - detected,
             "attach_s": p["attached"] - began, "process_group_s": p["process_group"] - p["attached"],
             "state_s": p["resumed"] - p["process_group"], "first_step_s": p["first_step"] - p["resumed"]}
    return {k: round(v, 3) for k, v in parts.items()} | {"in_place": "process_start" not in p}


def events_table(events: list[Event]) -> str:
    rows = [("event", "node", "at_step", "world", "recovery_s", "stall_s", "steps_redone")]
    for e in events:
        world = f"{e.world_size_before}->{e.world_size_after if e.world_size_after is not None else '?'}"
        rec = f"{e.recovery_s:.2f}" if e.recovery_s is not None else "-"
        stall = f"{e.stall_s:.2f}" if e.stall_s is not None else "-"
        rows.append((e.kind, e.node or "-", str(e.at_step), world, rec, stall, str(e.steps_redone)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def to_json(events: list[Event]) -> list[dict]:
    return [asdict(e) for e in events]
