"""Start watchdog: ends trainer pods that can never start, so that the Job's podFailurePolicy sees them.

    python3 startwatch.py --selector app.kubernetes.io/component=trainer,app.kubernetes.io/instance=mnist \
        --deadline 900 --pending-deadline 1800

Runs in the cluster (deploy/kustomize/base/startwatch.yaml) from a stock Python image with this file in a
ConfigMap, so an unpullable project image cannot block it: standard library only, no elastic_mnist import.
A pod waiting on a configuration error (an image that cannot be pulled, a missing Secret or ConfigMap key)
never becomes terminal by itself, so no failure policy sees it and a scheduled one holds its GPU. Every
--interval seconds this lists the job's pods; one waiting on such an error for --deadline seconds gets the
condition CONDITION (a message naming the reason and the fix, PATCH pods/status), then is deleted (uid
precondition). The kubelet keeps a condition it does not own (pkg/kubelet/status/status_manager.go,
mergePodStatus: `!kubetypes.PodConditionByKubelet(c.Type)`) and marks the deleted pod Failed
(TerminatePod, "Marking terminal pod as failed"); an unscheduled one is marked Failed by the pod GC
(pkg/controller/podgc/gc_controller.go, gcUnscheduledTerminating -> markFailedAndDeletePod, which keeps
the status' conditions). The Job's FailIndex rule on the condition then ends that index.
An unschedulable pod is ended only after --pending-deadline AND when no trainer of the job has run for as
long: an elastic job runs smaller when capacity is short, so a pending pod beside running peers is normal.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone

CONDITION = "elastic-mnist.io/StartDeadlineExceeded"
IMAGE_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName"})
CONFIG_REASONS = IMAGE_REASONS | {"CreateContainerConfigError"}
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
FIX = {
    "image": "the image cannot be pulled on this node: check its name and digest, the registry credentials "
             "(imagePullSecrets) and that nodes reach the registry; fix it and re-apply the Job",
    "config": "a Secret or ConfigMap (or a key in it) that the pod mounts or reads is missing: create it "
              "(docs/kubernetes.md); the next pod of the index picks it up",
    "pending": "no node can take the pod (GPU capacity, quota, taints): add capacity or lower parallelism",
}


@dataclass(frozen=True)
class Verdict:
    """What to do with one pod: the waiting reason, how long it waited, the message for the condition."""
    reason: str
    waited: float
    message: str


@dataclass(frozen=True)
class Request:
    """One API call, built by a pure function so the tests can read it."""
    method: str
    path: str
    body: dict | None = None
    content_type: str = "application/json"


def parse_time(stamp: str | None) -> float | None:
    """An RFC 3339 API timestamp (2026-12-01T16:00:00Z) as epoch seconds."""
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


def _condition(pod: dict, kind: str) -> dict:
    return next((c for c in pod.get("status", {}).get("conditions", []) if c.get("type") == kind), {})


def _quoted(state: dict) -> str:
    """The kubelet's or scheduler's own message, in parentheses (cut: a condition message is for people)."""
    message = (state.get("message") or "")[:300]
    return f" ({message})" if message else ""


def is_running(pod: dict) -> bool:
    return pod.get("status", {}).get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")


def decide(pod: dict, now: float, deadline: float, pending_deadline: float, peers_ran_at: float) -> Verdict | None:
    """Whether to end this pod now: a pure function of the pod object, the time, the two deadlines (0: off)
    and the last time any trainer of the job was seen running (peers_ran_at)."""
    status = pod.get("status", {})
    if pod["metadata"].get("deletionTimestamp") or status.get("phase") != "Pending":
        return None  # only Pending pods can be stuck before start; terminal and running ones are the Job's
    since = _waiting_since(pod)
    for s in _statuses(status):
        waiting = s.get("state", {}).get("waiting", {})
        if waiting.get("reason") in CONFIG_REASONS and deadline > 0 and since is not None and now - since >= deadline:
            fix = FIX["image" if waiting["reason"] in IMAGE_REASONS else "config"]
            return Verdict(waiting["reason"], now - since, f"container {s['name']} waited {now - since:.0f}s in "
                           f"{waiting['reason']}{_quoted(waiting)}: {fix}")
    scheduled = _condition(pod, "PodScheduled")
    created = parse_time(pod["metadata"].get("creationTimestamp"))
    if scheduled.get("status") != "False" or scheduled.get("reason") != "Unschedulable" or created is None:
        return None
    idle = now - max(created, peers_ran_at)  # how long the job has had no running trainer, this pod pending
    if pending_deadline > 0 and idle >= pending_deadline:
        return Verdict("Unschedulable", now - created, f"pending unschedulable {now - created:.0f}s with no trainer "
                       f"of the job running{_quoted(scheduled)}: {FIX['pending']}")
    return None


def list_request(namespace: str, selector: str) -> Request:
    query = urllib.parse.urlencode({"labelSelector": selector})
    return Request("GET", f"/api/v1/namespaces/{namespace}/pods?{query}")


def condition_patch(pod: dict, verdict: Verdict, now: float) -> Request:
    """A strategic merge patch of pods/status: conditions merge by type, so the others stay. The uid in the
    patch makes it fail on a pod that was replaced under the same name (uid is immutable)."""
    meta = pod["metadata"]
    condition = {"type": CONDITION, "status": "True", "reason": verdict.reason, "message": verdict.message,
                 "lastTransitionTime": format_time(now)}
    return Request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                   {"metadata": {"uid": meta["uid"]}, "status": {"conditions": [condition]}},
                   "application/strategic-merge-patch+json")


def delete_request(pod: dict) -> Request:
    """Delete exactly this pod (uid precondition), never a replacement of the same name."""
    meta = pod["metadata"]
    return Request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                   {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": meta["uid"]}})


class Api:
    """The API server with the pod's ServiceAccount; the token is re-read per call (it is rotated)."""

    def __init__(self, base: str, sa_dir: str = SA_DIR, timeout: float = 30.0):
        self.base, self.sa_dir, self.timeout = base, sa_dir, timeout
        self.tls = ssl.create_default_context(cafile=os.path.join(sa_dir, "ca.crt"))

    def send(self, req: Request) -> dict:
        with open(os.path.join(self.sa_dir, "token")) as f:
            token = f.read().strip()
        data = json.dumps(req.body).encode() if req.body is not None else None
        http = urllib.request.Request(self.base + req.path, data=data, method=req.method, headers={
            "Authorization": f"Bearer {token}", "Content-Type": req.content_type, "Accept": "application/json"})
        with urllib.request.urlopen(http, timeout=self.timeout, context=self.tls) as resp:
            return json.loads(resp.read() or b"{}")


def log(event: str, **fields) -> None:
    print(json.dumps({"time": format_time(time.time()), "event": event, **fields}), flush=True)


def act(api: Api, pod: dict, verdict: Verdict, now: float, dry_run: bool) -> None:
    name = pod["metadata"]["name"]
    fields = {"pod": name, "uid": pod["metadata"]["uid"], "reason": verdict.reason, "waited_s": round(verdict.waited)}
    if dry_run:
        log("start-deadline", action="none (dry run)", message=verdict.message, **fields)
        return
    try:
        api.send(condition_patch(pod, verdict, now))
        api.send(delete_request(pod))
    except urllib.error.HTTPError as e:  # 404/409: gone or replaced meanwhile; anything else: next sweep
        log("start-deadline", action=f"failed: HTTP {e.code} {e.reason}", **fields)
        return
    log("start-deadline", action=f"marked {CONDITION} and deleted", message=verdict.message, **fields)


def sweep(api: Api, opts: argparse.Namespace, peers_ran_at: float, now: float) -> float:
    """One pass; returns the updated time a trainer was last seen running."""
    pods = api.send(list_request(opts.namespace, opts.selector)).get("items", [])
    if any(is_running(p) for p in pods):
        peers_ran_at = now
    for pod in pods:
        verdict = decide(pod, now, opts.deadline, opts.pending_deadline, peers_ran_at)
        if verdict:
            act(api, pod, verdict, now, opts.dry_run)
    return peers_ran_at


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="startwatch", description=__doc__.split("\n\n")[0])
    p.add_argument("--selector", required=True, help="label selector of the job's trainer pods")
    p.add_argument("--namespace", default=None, help="default: the ServiceAccount's namespace")
    p.add_argument("--deadline", type=float, default=900.0,
                   help="seconds a pod may wait on an image or configuration error (0: never end one)")
    p.add_argument("--pending-deadline", type=float, default=1800.0,
                   help="seconds a pod may stay unschedulable while no trainer runs (0: never end one)")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between sweeps")
    p.add_argument("--dry-run", action="store_true", help="log what would be done, change nothing")
    opts = p.parse_args(argv)
    if opts.deadline < 0 or opts.pending_deadline < 0 or opts.interval <= 0:
        p.error("--deadline and --pending-deadline must be >= 0 (0 turns one off), --interval > 0")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    if opts.namespace is None:
        with open(os.path.join(SA_DIR, "namespace")) as f:
            opts.namespace = f.read().strip()
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    api = Api(f"https://{'[' + host + ']' if ':' in host else host}:{port}")
    log("start", namespace=opts.namespace, selector=opts.selector, deadline_s=opts.deadline,
        pending_deadline_s=opts.pending_deadline, dry_run=opts.dry_run)
    peers_ran_at = time.time()  # a restarted watchdog counts from its start: it never ends pods early
    while True:
        try:
            peers_ran_at = sweep(api, opts, peers_ran_at, time.time())
        except (OSError, ValueError) as e:  # API unreachable or a bad answer: log it, try again next sweep
            log("sweep-failed", error=f"{type(e).__name__}: {e}")
        time.sleep(opts.interval)


if __name__ == "__main__":
    sys.exit(main())
