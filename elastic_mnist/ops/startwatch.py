"""Start watchdog: ends trainer pods that can never start, reports those that wait for capacity, and keeps
trainers off a node that failed one of them node-locally.

    python3 startwatch.py --selector app.kubernetes.io/component=trainer,app.kubernetes.io/instance=mnist \
        --deadline 900 --pending-deadline 0 --avoid-label avoid.elastic-mnist.io/mnist --node-local-exit preflight:69

Runs in the cluster (deploy/kustomize/base/startwatch.yaml) from a stock Python image with this file and
startrules.py (its decisions) in a ConfigMap, so an unpullable project image cannot block it: standard
library only, no elastic_mnist import when run so.
A pod that waits on an image it cannot pull, a missing Secret, ConfigMap, key or claim never becomes
terminal by itself, so no failure policy sees it. Every --interval seconds this lists the job's pods (and
the kubelet's FailedMount events: a volume that cannot be mounted leaves the containers waiting in
PodInitializing, with no reason of their own). A pod it ends gets a condition (PATCH pods/status: a
message naming the cause and the fix) and is deleted (uid precondition); the Job's podFailurePolicy acts
on the condition (deploy/kustomize/base/trainer.yaml). The kubelet keeps a condition it does not own
(pkg/kubelet/status/status_manager.go, mergePodStatus) and marks the deleted pod Failed (TerminatePod); an
unscheduled one is marked Failed by the pod GC (pkg/controller/podgc/gc_controller.go,
gcUnscheduledTerminating -> markFailedAndDeletePod, which keeps the status' conditions).
  - STUCK (FailIndex) after --deadline: an image pull error, or a volume that fails to mount (this node).
  - CANNOT_START (FailJob) after --deadline with no trainer running as long: a missing object (Secret,
    ConfigMap, key, claim, an unbound claim); while trainers run, such a pod is only reported (WAITING).
  - CANNOT_START after --pending-deadline unschedulable with no trainer running (0: never; the spot
    variants wait for capacity). Before that, after --report-after, it is reported (WAITING).
  - NODE_AVOIDED (Ignore): a pending pod on a node marked for this job, so its index starts elsewhere.
A failed pod whose --node-local-exit container exited with that code marks its node with the label
--avoid-label (value: the time), which the trainers' required node affinity avoids; marks expire after
--avoid-for (a non-numeric value set by hand never does).
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

if __package__:  # imported as elastic_mnist.ops.startwatch (the tests)
    from elastic_mnist.ops import startrules as rules
else:  # run as a script from its ConfigMap: startrules.py lies beside it (also under `python3 -I`)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import startrules as rules  # type: ignore[no-redef]

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class Request:
    """One API call, built by a pure function so the tests can read it."""
    method: str
    path: str
    body: dict | None = None
    content_type: str = "application/json"


def list_request(namespace: str, selector: str) -> Request:
    return Request("GET", f"/api/v1/namespaces/{namespace}/pods?{urllib.parse.urlencode({'labelSelector': selector})}")


def events_request(namespace: str) -> Request:
    query = urllib.parse.urlencode({"fieldSelector": "involvedObject.kind=Pod,reason=FailedMount"})
    return Request("GET", f"/api/v1/namespaces/{namespace}/events?{query}")


def nodes_request(label: str) -> Request:
    return Request("GET", f"/api/v1/nodes?{urllib.parse.urlencode({'labelSelector': label})}")


def label_request(node: str, label: str, value: str | None) -> Request:
    """Set (or with None remove) one label of a node: a JSON merge patch touches nothing else."""
    return Request("PATCH", f"/api/v1/nodes/{node}", {"metadata": {"labels": {label: value}}},
                   "application/merge-patch+json")


def condition_patch(pod: dict, verdict: rules.Verdict, now: float) -> Request:
    """A strategic merge patch of pods/status: conditions merge by type, so the others stay. The uid in the
    patch makes it fail on a pod that was replaced under the same name (uid is immutable)."""
    meta = pod["metadata"]
    condition = {"type": verdict.condition, "status": "True", "reason": verdict.reason, "message": verdict.message,
                 "lastTransitionTime": rules.format_time(now)}
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
    print(json.dumps({"time": rules.format_time(time.time()), "event": event, **fields}), flush=True)


def _send_all(api: Api, requests: list[Request], what: str, dry_run: bool, **fields) -> None:
    try:
        for req in [] if dry_run else requests:
            api.send(req)
    except urllib.error.HTTPError as e:  # 404/409: gone or replaced meanwhile; anything else: next sweep
        log(what, action=f"failed: HTTP {e.code} {e.reason}", **fields)
        return
    log(what, action="none (dry run)" if dry_run else "done", **fields)


def act(api: Api, pod: dict, verdict: rules.Verdict, now: float, dry_run: bool) -> None:
    if not verdict.end and rules.condition_of(pod, verdict.condition).get("reason") == verdict.reason:
        return  # reported already
    requests = [condition_patch(pod, verdict, now)] + ([delete_request(pod)] if verdict.end else [])
    _send_all(api, requests, "ended" if verdict.end else "reported", dry_run, pod=pod["metadata"]["name"],
              uid=pod["metadata"]["uid"], condition=verdict.condition, reason=verdict.reason,
              waited_s=round(verdict.waited), message=verdict.message)


def mark_nodes(api: Api, pods: list[dict], marks: dict[str, str], opts, now: float) -> None:
    """Mark the node of each new node-local failure; drop the marks that expired."""
    for pod in (p for p in pods if rules.node_local_failure(p, opts.node_local_exit)):
        node = pod["spec"]["nodeName"]
        done = rules.Verdict(rules.NODE_MARKED, "NodeMarked", 0.0, f"node {node} marked {opts.avoid_label}={int(now)}")
        _send_all(api, [label_request(node, opts.avoid_label, str(int(now))), condition_patch(pod, done, now)],
                  "node-marked", opts.dry_run, node=node, pod=pod["metadata"]["name"], label=opts.avoid_label,
                  clear=f"kubectl label node {node} {opts.avoid_label}-")
    for node, value in marks.items():
        if rules.expired(value, now, opts.avoid_for):
            _send_all(api, [label_request(node, opts.avoid_label, None)], "node-unmarked", opts.dry_run, node=node)


def sweep(api: Api, opts: argparse.Namespace, peers_ran_at: float, now: float) -> float:
    """One pass; returns the updated time a trainer was last seen running."""
    pods = api.send(list_request(opts.namespace, opts.selector)).get("items", [])
    marks = {n["metadata"]["name"]: n["metadata"]["labels"][opts.avoid_label]
             for n in api.send(nodes_request(opts.avoid_label)).get("items", [])} if opts.avoid_label else {}
    mounts = rules.mount_messages(api.send(events_request(opts.namespace)).get("items", []), now)
    if any(rules.is_running(p) for p in pods):
        peers_ran_at = now
    for pod in pods:
        verdict = rules.decide(pod, now, opts, peers_ran_at, mounts.get(pod["metadata"]["uid"], []), frozenset(marks))
        if verdict:
            act(api, pod, verdict, now, opts.dry_run)
    if opts.avoid_label:
        mark_nodes(api, pods, marks, opts, now)
    return peers_ran_at


def _exits(text: str) -> dict[str, int]:
    """'preflight:69,trainer:70' -> {'preflight': 69, 'trainer': 70}."""
    pairs = [item.split(":") for item in text.split(",") if item]
    if any(len(p) != 2 or not p[1].isdigit() for p in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected CONTAINER:CODE[,CONTAINER:CODE...]")
    return {name: int(code) for name, code in pairs}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="startwatch", description=__doc__.split("\n\n")[0])
    p.add_argument("--selector", required=True, help="label selector of the job's trainer pods")
    p.add_argument("--namespace", default=None, help="default: the ServiceAccount's namespace")
    p.add_argument("--deadline", type=float, default=900.0,
                   help="seconds a pod may wait on an image, a volume or a missing object (0: never end one)")
    p.add_argument("--pending-deadline", type=float, default=1800.0,
                   help="seconds unschedulable with no trainer running before the Job fails (0: wait for capacity)")
    p.add_argument("--report-after", type=float, default=600.0, help="seconds unschedulable before it is reported")
    p.add_argument("--avoid-label", default="", help="node label that marks a node for this job (empty: no marks)")
    p.add_argument("--avoid-for", type=float, default=21600.0, help="seconds a mark set by the watchdog lasts")
    p.add_argument("--node-local-exit", type=_exits, default={}, help="CONTAINER:CODE exits that mark the node")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between sweeps")
    p.add_argument("--dry-run", action="store_true", help="log what would be done, change nothing")
    opts = p.parse_args(argv)
    if min(opts.deadline, opts.pending_deadline, opts.report_after, opts.avoid_for) < 0 or opts.interval <= 0:
        p.error("--deadline, --pending-deadline, --report-after and --avoid-for must be >= 0 (0 turns one off), "
                "--interval > 0")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    if opts.namespace is None:
        with open(os.path.join(SA_DIR, "namespace")) as f:
            opts.namespace = f.read().strip()
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    api = Api(f"https://{'[' + host + ']' if ':' in host else host}:{port}")
    log("start", **{k: v for k, v in vars(opts).items() if k != "node_local_exit"})
    peers_ran_at = time.time()  # a restarted watchdog counts from its start: it never ends pods early
    while True:
        try:
            peers_ran_at = sweep(api, opts, peers_ran_at, time.time())
        except (OSError, ValueError, KeyError) as e:  # API unreachable or a bad answer: log it, next sweep
            log("sweep-failed", error=f"{type(e).__name__}: {e}")
        time.sleep(opts.interval)


if __name__ == "__main__":
    sys.exit(main())
