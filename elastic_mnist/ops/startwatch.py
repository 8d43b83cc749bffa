"""`elastic-mnist startwatch`, the start watchdog: ends trainer pods that can never start, reports those that wait for
capacity, keeps trainers off a node that failed one of them node-locally, fails the Job when every node that could
take a trainer is marked, and releases the index of a pod whose node will never answer again.

    elastic-mnist startwatch --selector app.kubernetes.io/component=trainer,app.kubernetes.io/instance=mnist \\
        --deadline 900 --avoid-label avoid.elastic-mnist.io/mnist --node-local-exit preflight:69 --job trainer

Runs in the cluster (deploy/kustomize/base/startwatch.yaml) from the project's image, standard library only (no
torch: a small container). A pod that waits on an image it cannot pull, a missing Secret, ConfigMap, key or claim
never becomes terminal by itself, so no failure policy sees it. Every --interval seconds this lists the job's pods
(and the kubelet's FailedMount events: a volume that cannot be mounted leaves the containers waiting in
PodInitializing, with no reason of their own). A pod it ends gets a condition (PATCH pods/status: a message naming
the cause and the fix) and is deleted (uid precondition); the Job's podFailurePolicy acts on the condition
(deploy/kustomize/base/trainer.yaml). The kubelet keeps a condition it does not own
(pkg/kubelet/status/status_manager.go, mergePodStatus) and marks the deleted pod Failed (TerminatePod); an
unscheduled one is marked Failed by the pod GC (pkg/controller/podgc/gc_controller.go,
gcUnscheduledTerminating -> markFailedAndDeletePod, which keeps the status' conditions).
  - STUCK (FailIndex) after --deadline: an image pull error, or a volume that fails to mount (this node).
  - CANNOT_START (FailJob) after --deadline with no trainer running as long: a missing object (Secret,
    ConfigMap, key, claim, an unbound claim); while trainers run, such a pod is only reported (WAITING).
  - CANNOT_START after --marked-deadline unschedulable with no trainer running while every node that could take a
    trainer is marked (noderules.feasible_nodes), and after --pending-deadline for any other reason (0: never).
    Before that, after --report-after, it is reported (WAITING).
  - NODE_AVOIDED (Ignore): a pending pod on a node marked for this job, so its index starts elsewhere.
  - NODE_LOST (Ignore): a deleted pod on a node NotReady for --node-lost-after, its grace period over as long: made
    Failed and removed without its kubelet (noderules.lost), so that the Job replaces it.
A failed pod whose --node-local-exit container exited with that code marks its node with the label
--avoid-label (value: the time), which the trainers' required node affinity avoids; marks expire after
--avoid-for (a non-numeric value set by hand never does). Every pass ends with the time on the Job's annotation
elastic-mnist.io/watchdog-heartbeat (--job) and on --alive-file (the container's liveness probe reads its age).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
from pathlib import Path

from elastic_mnist.ops import noderules
from elastic_mnist.ops import startrules as rules
from elastic_mnist.ops.kubeapi import (  # noqa: F401 - the request builders, re-exported for the tests
    SA_DIR,
    Api,
    Request,
    delete_request,
    events_request,
    heartbeat_request,
    label_request,
    list_request,
    nodes_request,
    status_patch,
)


def condition_patch(pod: dict, verdict: rules.Verdict, now: float, phase: str | None = None) -> Request:
    condition = {"type": verdict.condition, "status": "True", "reason": verdict.reason, "message": verdict.message,
                 "lastTransitionTime": rules.format_time(now)}
    return status_patch(pod, condition, phase)


def log(event: str, **fields) -> None:
    print(json.dumps({"time": rules.format_time(time.time()), "event": event, **fields}), flush=True)


def _send_all(api: Api, requests: list[Request], what: str, dry_run: bool, **fields) -> bool:
    try:
        for req in [] if dry_run else requests:
            api.send(req)
    except urllib.error.HTTPError as e:  # 404/409: gone or replaced meanwhile; anything else: next sweep
        log(what, action=f"failed: HTTP {e.code} {e.reason}", **fields)
        return False
    log(what, action="none (dry run)" if dry_run else "done", **fields)
    return True


def act(api: Api, pod: dict, verdict: rules.Verdict, now: float, dry_run: bool) -> None:
    if not verdict.end and rules.condition_of(pod, verdict.condition).get("reason") == verdict.reason:
        return  # reported already
    if verdict.condition == rules.NODE_LOST:  # its kubelet will not end it: made terminal here, then removed
        requests = [condition_patch(pod, verdict, now, phase="Failed"), delete_request(pod, force=True)]
    else:
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
    nodes = api.send(nodes_request()).get("items", []) if rules.needs_nodes(pods, now, opts, peers_ran_at) else None
    by_name = {n["metadata"]["name"]: n for n in nodes or []}
    for pod in pods:
        feasible = noderules.feasible_nodes(pod, nodes, opts.avoid_label) if nodes is not None else None
        verdict = rules.decide(pod, now, opts, peers_ran_at, mounts.get(pod["metadata"]["uid"], []),
                               frozenset(marks), feasible) or \
            noderules.lost(pod, by_name.get(pod.get("spec", {}).get("nodeName")), now, opts.node_lost_after)
        if verdict:
            act(api, pod, verdict, now, opts.dry_run)
    if opts.avoid_label:
        mark_nodes(api, pods, marks, opts, now)
    return peers_ran_at


class Heartbeat:
    """Where a working watchdog shows that it works: the Job's annotation after every complete pass (an
    operator's view), the alive file after every pass, complete or not (the liveness probe: a loop that stopped
    turning is restarted; an API that does not answer is not the container's to fix)."""

    def __init__(self, api: Api, opts: argparse.Namespace):
        self.api, self.opts, self.failing = api, opts, False

    def alive(self) -> None:
        if self.opts.alive_file:
            Path(self.opts.alive_file).touch()

    def passed(self, now: float) -> None:
        if not self.opts.job or self.opts.dry_run:
            return
        try:
            self.api.send(heartbeat_request(self.opts.namespace, self.opts.job, now))
        except (OSError, ValueError) as e:  # the Job gone (404) or the API away: said once, until it works again
            if not self.failing:
                log("heartbeat-failed", job=self.opts.job, error=f"{type(e).__name__}: {e}")
            self.failing = True
            return
        self.failing = False


def _exits(text: str) -> dict[str, int]:
    """'preflight:69,trainer:70' -> {'preflight': 69, 'trainer': 70}."""
    pairs = [item.split(":") for item in text.split(",") if item]
    if any(len(p) != 2 or not p[1].isdigit() for p in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected CONTAINER:CODE[,CONTAINER:CODE...]")
    return {name: int(code) for name, code in pairs}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="elastic-mnist startwatch", description=__doc__.split("\n\n")[0])
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
    p.add_argument("--marked-deadline", type=float, default=900.0,
                   help="seconds unschedulable with no trainer running while every node that could take a trainer "
                        "is marked, before the Job fails (time for an autoscaler to add one; 0: never)")
    p.add_argument("--node-lost-after", type=float, default=0.0,
                   help="seconds a deleted pod may outlive its grace period on a node that is not Ready (as long) "
                        "before it is made Failed and removed (0: never; needs to list nodes)")
    p.add_argument("--job", default="", help="the Job whose annotation carries the heartbeat (empty: none)")
    p.add_argument("--alive-file", default="", help="file touched after every pass, for a liveness probe")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between sweeps")
    p.add_argument("--dry-run", action="store_true", help="log what would be done, change nothing")
    opts = p.parse_args(argv)
    times = (opts.deadline, opts.pending_deadline, opts.report_after, opts.avoid_for, opts.marked_deadline,
             opts.node_lost_after)
    if min(times) < 0 or opts.interval <= 0:
        p.error("--deadline, --pending-deadline, --report-after, --avoid-for, --marked-deadline and "
                "--node-lost-after must be >= 0 (0 turns one off), --interval > 0")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    if opts.namespace is None:
        with open(os.path.join(SA_DIR, "namespace")) as f:
            opts.namespace = f.read().strip()
    api = Api.in_cluster()
    heartbeat = Heartbeat(api, opts)
    log("start", **{k: v for k, v in vars(opts).items() if k != "node_local_exit"})
    peers_ran_at = time.time()  # a restarted watchdog counts from its start: it never ends pods early
    while True:
        peers_ran_at = one_pass(api, opts, heartbeat, peers_ran_at, time.time())
        time.sleep(opts.interval)


def one_pass(api: Api, opts: argparse.Namespace, heartbeat: Heartbeat, peers_ran_at: float, now: float) -> float:
    """A sweep between the two heartbeats: the alive file whatever happens, the Job's annotation once it is done."""
    heartbeat.alive()
    try:
        peers_ran_at = sweep(api, opts, peers_ran_at, now)
    except (OSError, ValueError, KeyError) as e:  # API unreachable or a bad answer: log it, next sweep
        log("sweep-failed", error=f"{type(e).__name__}: {e}")
        return peers_ran_at
    heartbeat.passed(now)
    return peers_ran_at


if __name__ == "__main__":
    sys.exit(main())
