"""The start watchdog's decisions: what to do with one trainer pod, from the pod object alone (pure
functions, so the tests and the Job policy model read them). startwatch.py runs them against the API;
noderules.py holds the decisions that need the nodes.

    python3 -c "from elastic_mnist.ops import startrules; print(startrules.STUCK)"

Standard library only: the watchdog's container stays small (no torch is imported).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from datetime import datetime, timezone

STUCK = "elastic-mnist.io/StartDeadlineExceeded"
CANNOT_START = "elastic-mnist.io/CannotStart"
NODE_AVOIDED = "elastic-mnist.io/NodeAvoided"
WAITING = "elastic-mnist.io/Waiting"
NODE_MARKED = "elastic-mnist.io/NodeMarked"
NODE_LOST = "elastic-mnist.io/NodeLost"
CONDITION = STUCK  # the first one this watchdog had
IMAGE_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName"})
CONFIG_REASONS = IMAGE_REASONS | {"CreateContainerConfigError"}
# What the kubelet (pkg/volume/secret, configmap: "references non-existent ... key"; its object managers:
# `secret "NAME" not found`) and the scheduler (pkg/scheduler/framework/plugins/volumebinding) say about an
# object that is missing in the namespace: no node can get past it.
MISSING = re.compile(r'\b(secrets?|configmaps?|persistentvolumeclaims?) "[^"]+" not found'
                     r"|references non-existent \w+ key: \S+|couldn't find key \S+ in \w+ \S+"
                     r"|pod has unbound immediate PersistentVolumeClaims")
EVENT_FRESH_S = 600.0  # the kubelet retries a mount every ~2 minutes: an older event is an old problem
FIX = {
    "image": "the image cannot be pulled on this node: check its name and digest, the registry credentials "
             "(imagePullSecrets) and that nodes reach the registry; fix it and re-apply the Job",
    "mount": "a volume cannot be mounted on this node: see `kubectl describe pod` (FailedMount) and the "
             "storage driver on the node",
    "config": "create the missing object (docs/kubernetes.md, \"First apply\") and re-apply the Job",
    "pending": "no node can take the pod (GPU capacity, quota, taints, nodes marked for this job): add "
               "capacity or lower parallelism, then re-apply the Job",
    "marked": "repair those nodes and clear their marks (kubectl label node NODE LABEL-), or add nodes (a cluster "
              "autoscaler adds none: docs/kubernetes.md, \"A bad node\"), then re-apply the Job",
}


@dataclass(frozen=True)
class Verdict:
    """What to do with one pod: set `condition` (reason, message), and delete the pod if `end`."""
    condition: str
    reason: str
    waited: float
    message: str
    end: bool = True


def parse_time(stamp: str | None) -> float | None:
    """An RFC 3339 API timestamp (2026-12-01T16:00:00Z, or with microseconds) as epoch seconds."""
    if not stamp:
        return None
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).astimezone(timezone.utc).timestamp()


def format_time(now: float) -> str:
    return datetime.fromtimestamp(int(now), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _statuses(status: dict) -> list[dict]:
    return status.get("initContainerStatuses", []) + status.get("containerStatuses", [])


def _waiting_since(pod: dict) -> float | None:
    """The pod's last progress: when the kubelet took it, or the latest init container finish after that
    (a container waits from the moment the one before it ended, not from the pod's start)."""
    status = pod.get("status", {})
    times = [parse_time(status.get("startTime"))]
    times += [parse_time(s.get("state", {}).get("terminated", {}).get("finishedAt")) for s in _statuses(status)]
    known = [t for t in times if t is not None]
    return max(known) if known else None


def condition_of(pod: dict, kind: str) -> dict:
    return next((c for c in pod.get("status", {}).get("conditions", []) if c.get("type") == kind), {})


def _quoted(text: str | None) -> str:
    """The kubelet's or scheduler's own words, in parentheses (cut: a condition message is for people)."""
    return f" ({text[:300]})" if text else ""


def is_running(pod: dict) -> bool:
    return pod.get("status", {}).get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")


def _stuck(pod: dict, mounts: list[str]) -> tuple[str, str, str] | None:
    """(kind, reason, the kubelet's words) for a scheduled pod that waits on something: an image, a missing
    object, a volume; None when it is merely slow (a big image pulls in ContainerCreating)."""
    for s in _statuses(pod.get("status", {})):
        waiting = s.get("state", {}).get("waiting", {})
        if waiting.get("reason") in CONFIG_REASONS:
            kind = "image" if waiting["reason"] in IMAGE_REASONS else "config"
            words = f"container {s['name']} in {waiting['reason']}{_quoted(waiting.get('message'))}"
            return kind, waiting["reason"], words
    if mounts and pod.get("spec", {}).get("nodeName"):
        return ("config" if MISSING.search(mounts[-1]) else "mount"), "FailedMount", f"FailedMount{_quoted(mounts[-1])}"
    return None


def decide(pod: dict, now: float, opts: argparse.Namespace, peers_ran_at: float, mounts: list[str] = (),
           marked: frozenset[str] = frozenset(), feasible: frozenset[str] | None = None) -> Verdict | None:
    """What to do with this pod now: a pure function of the pod object, its FailedMount messages, the nodes
    marked for the job, the nodes that could take it but for the marks (None: not known, noderules.py), the time,
    the options and when a trainer of the job was last seen running."""
    if pod["metadata"].get("deletionTimestamp") or pod.get("status", {}).get("phase") != "Pending":
        return None  # only Pending pods can be stuck before start; terminal and running ones are the Job's
    node = pod.get("spec", {}).get("nodeName")
    if node in marked:
        return Verdict(NODE_AVOIDED, "NodeAvoided", 0.0, f"node {node} is marked {opts.avoid_label} for this job "
                       "(a trainer failed there node-locally); ended so that its index starts on another node")
    since, stuck = _waiting_since(pod), _stuck(pod, list(mounts))
    if stuck and since is not None and opts.deadline > 0 and now - since >= opts.deadline:
        kind, reason, words = stuck
        text = f"waited {now - since:.0f}s: {words}: {FIX[kind]}"
        return _config(reason, now - since, text, now - peers_ran_at, opts) if kind == "config" else \
            Verdict(STUCK, reason, now - since, text)
    return _unschedulable(pod, now, opts, peers_ran_at, marked, feasible)


def _config(reason: str, waited: float, text: str, idle: float, opts) -> Verdict:
    """A missing object fails the Job only when no trainer has run for the deadline: a run in progress is
    not ended because one of its replacements cannot start (the object may come back; it is reported)."""
    if idle >= opts.deadline:
        return Verdict(CANNOT_START, reason, waited, text)
    return Verdict(WAITING, reason, waited, f"{text} (trainers of the job run: reported, not ended)", end=False)


def unschedulable_since(pod: dict) -> float | None:
    """When the scheduler first saw this pod (its creation), if it says it cannot place it now."""
    scheduled = condition_of(pod, "PodScheduled")
    if scheduled.get("status") != "False" or scheduled.get("reason") != "Unschedulable":
        return None
    return parse_time(pod["metadata"].get("creationTimestamp"))


def _unschedulable(pod: dict, now: float, opts, peers_ran_at: float, marked: frozenset[str],
                   feasible: frozenset[str] | None) -> Verdict | None:
    created = unschedulable_since(pod)
    if created is None:
        return None
    waited, words = now - created, condition_of(pod, "PodScheduled").get("message")
    if MISSING.search(words or ""):
        if opts.deadline > 0 and waited >= opts.deadline:
            return _config("Unschedulable", waited, f"pending {waited:.0f}s{_quoted(words)}: {FIX['config']}",
                           now - peers_ran_at, opts)
        return None
    idle = now - max(created, peers_ran_at)  # how long the job has had no running trainer, this pod pending
    if feasible and feasible <= marked and opts.marked_deadline > 0 and idle >= opts.marked_deadline:
        return Verdict(CANNOT_START, "EveryNodeMarked", waited, f"every node that could take a trainer "
                       f"({', '.join(sorted(feasible))}) is marked {opts.avoid_label} for this job (a trainer failed "
                       f"there node-locally), and no trainer ran for {idle:.0f}s: no other node came in that time; "
                       f"{FIX['marked']}")
    avoided = f"; nodes marked for this job: {', '.join(sorted(marked))}" if marked else ""
    if opts.pending_deadline > 0 and idle >= opts.pending_deadline:
        return Verdict(CANNOT_START, "Unschedulable", waited, f"pending unschedulable {waited:.0f}s with no trainer "
                       f"of the job running{_quoted(words)}{avoided}: {FIX['pending']}")
    if opts.report_after > 0 and waited >= opts.report_after:
        return Verdict(WAITING, "WaitingForCapacity", waited, f"waiting for capacity {waited:.0f}s (not ended: "
                       f"it starts when a node can take it){_quoted(words)}{avoided}", end=False)
    return None


def needs_nodes(pods: list[dict], now: float, opts, peers_ran_at: float) -> bool:
    """Whether a decision this sweep needs every node (listed only then): a pod that waits unschedulable while no
    trainer runs, long enough for the every-node-marked rule, or a deleted pod its node has not ended."""
    def marked_candidate(p: dict) -> bool:
        since = unschedulable_since(p)
        return bool(opts.avoid_label) and opts.marked_deadline > 0 and since is not None and \
            now - max(since, peers_ran_at) >= opts.marked_deadline

    def lost_candidate(p: dict) -> bool:
        deleted = parse_time(p["metadata"].get("deletionTimestamp"))
        return opts.node_lost_after > 0 and deleted is not None and now - deleted >= opts.node_lost_after and \
            p.get("status", {}).get("phase") not in ("Succeeded", "Failed") and bool(p.get("spec", {}).get("nodeName"))

    return any(marked_candidate(p) or lost_candidate(p) for p in pods)


def node_local_failure(pod: dict, exits: dict[str, int]) -> bool:
    """A Failed pod whose container named in `exits` ended with that code, not yet used to mark its node."""
    if pod.get("status", {}).get("phase") != "Failed" or condition_of(pod, NODE_MARKED):
        return False
    codes = {s["name"]: s.get("state", {}).get("terminated", {}).get("exitCode") for s in _statuses(pod["status"])}
    return bool(pod.get("spec", {}).get("nodeName")) and any(codes.get(c) == code for c, code in exits.items())


def expired(value: str, now: float, avoid_for: float) -> bool:
    """A mark the watchdog set (its time) older than avoid_for; one set by hand (any other value) stays."""
    return value.isdigit() and avoid_for > 0 and now - int(value) >= avoid_for


def mount_messages(events: list[dict], now: float) -> dict[str, list[str]]:
    """Pod uid -> its fresh FailedMount messages, oldest first."""
    out: dict[str, list[tuple[float, str]]] = {}
    for e in events:
        last = parse_time(e.get("lastTimestamp") or e.get("eventTime")) or 0.0
        if now - last <= EVENT_FRESH_S:
            out.setdefault(e.get("involvedObject", {}).get("uid", ""), []).append((last, e.get("message", "")))
    return {uid: [m for _, m in sorted(items)] for uid, items in out.items()}
