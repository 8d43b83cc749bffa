"""Trainer pod objects as the API server returns them (the fields the kubelet, scheduler and pod GC set),
for the start watchdog's tests (tests/test_startwatch.py) and the Job policy model (tests/test_k8s_policy.py).
Shapes follow `kubectl get pod -o json` of an Indexed Job's pod: preflight init container, trainer container;
events follow `kubectl get events -o json` (the kubelet's FailedMount)."""

from __future__ import annotations

import copy

from elastic_mnist.ops.startrules import format_time, parse_time

T0 = parse_time("2026-12-01T12:00:00Z")  # the pod's creation
NAMESPACE = "elastic-mnist"


def waiting(name: str, reason: str, message: str = "") -> dict:
    state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
    return {"name": name, "ready": False, "restartCount": 0, "started": False, "state": state}


def terminated(name: str, code: int, finished: float, reason: str = "Completed") -> dict:
    return {"name": name, "ready": False, "restartCount": 0, "started": False,
            "state": {"terminated": {"exitCode": code, "reason": reason, "finishedAt": format_time(finished)}}}


def running(name: str, since: float) -> dict:
    return {"name": name, "ready": True, "restartCount": 0, "started": True,
            "state": {"running": {"startedAt": format_time(since)}}}


def pod(name: str = "trainer-0-x7k2p", uid: str = "5b0f6a3e-0000-4000-8000-000000000001", phase: str = "Pending",
        init: list[dict] | None = None, containers: list[dict] | None = None, started: float | None = T0 + 2,
        conditions: list[dict] | None = None, deleting: bool = False, node: str | None = "gpu-node-1") -> dict:
    """A scheduled trainer pod (started: when the kubelet took it; None: not yet on a node)."""
    meta = {"name": name, "namespace": NAMESPACE, "uid": uid, "creationTimestamp": format_time(T0),
            "labels": {"app.kubernetes.io/component": "trainer", "app.kubernetes.io/instance": "mnist",
                       "batch.kubernetes.io/job-completion-index": name.split("-")[1]}}
    if deleting:
        meta["deletionTimestamp"] = format_time(T0 + 3600)
    status = {"phase": phase, "conditions": conditions if conditions is not None else [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": format_time(T0 + 1)}]}
    if started is not None:
        status["startTime"] = format_time(started)
    if init is not None:
        status["initContainerStatuses"] = init
    if containers is not None:
        status["containerStatuses"] = containers
    spec = {"nodeName": node} if node and started is not None else {}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": status}


def stuck(reason: str, container: str = "preflight", message: str = "", **kw) -> dict:
    """Waiting on `reason` in the preflight init container, or in the trainer after preflight passed."""
    if container == "preflight":
        return pod(init=[waiting("preflight", reason, message)],
                   containers=[waiting("trainer", "PodInitializing")], **kw)
    return pod(init=[terminated("preflight", 0, T0 + 60)], containers=[waiting("trainer", reason, message)], **kw)


def unschedulable(message: str = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.", **kw) -> dict:
    return pod(started=None, conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                          "message": message, "lastTransitionTime": format_time(T0 + 1)}], **kw)


def terminated_after_delete(p: dict, condition: dict | None) -> dict:
    """The pod once deleted, with the watchdog's condition: a scheduled one as the kubelet leaves it
    (pkg/kubelet/status/status_manager.go, TerminatePod: the started init containers and, once
    initialized, the app containers without a terminated state get exit 137 ContainerStatusUnknown; the
    phase becomes Failed; mergePodStatus keeps the condition), an unscheduled one as the pod GC does
    (gc_controller.go, markFailedAndDeletePod: phase Failed, the status otherwise kept)."""
    p = copy.deepcopy(p)
    status = p["status"]
    status["phase"] = "Failed"
    status["conditions"] = status.get("conditions", []) + ([condition] if condition else [])
    unknown = {"exitCode": 137, "reason": "ContainerStatusUnknown",
               "message": "The container could not be located when the pod was terminated"}
    inits = status.get("initContainerStatuses", [])
    last = inits[-1]["state"] if inits else {}
    initialized = last.get("terminated", {}).get("exitCode") == 0
    started_inits = [s for s in inits if "waiting" not in s["state"]] or inits[:1]  # initializedContainers
    for s in started_inits + (status.get("containerStatuses", []) if initialized or not inits else []):
        if "terminated" not in s["state"]:
            s["state"] = {"terminated": dict(unknown)}
    return p


SECRET_MISSING = 'MountVolume.SetUp failed for volume "etcd-credentials" : secret "elastic-mnist-etcd" not found'
KEY_MISSING = 'MountVolume.SetUp failed for volume "etcd-credentials" : references non-existent secret key: rdzv-secret'
MOUNT_TIMEOUT = ("MountVolume.SetUp failed for volume \"pvc-1\" : rpc error: code = DeadlineExceeded desc = "
                 "context deadline exceeded")


def mounting(**kw) -> dict:
    """Scheduled, every container waiting behind a volume that does not mount (Init:0/1, PodInitializing)."""
    return pod(init=[waiting("preflight", "PodInitializing")], containers=[waiting("trainer", "PodInitializing")],
               **kw)


def mount_event(p: dict, message: str, last: float) -> dict:
    """The kubelet's FailedMount event for pod p, last seen at `last` (events are aggregated: count, last)."""
    meta = p["metadata"]
    return {"apiVersion": "v1", "kind": "Event", "type": "Warning", "reason": "FailedMount", "message": message,
            "count": 7, "lastTimestamp": format_time(last), "source": {"component": "kubelet"},
            "involvedObject": {"kind": "Pod", "namespace": meta["namespace"], "name": meta["name"], "uid": meta["uid"]}}


def exited(container: str, code: int, node: str = "gpu-node-1", finished: float = T0 + 80, reason: str = "Error",
           conditions: list[dict] | None = None, **kw) -> dict:
    """A Failed pod: its preflight (or, after a passed preflight, its trainer) exited with `code`."""
    init = [terminated("preflight", code if container == "preflight" else 0, finished, reason)]
    app = [waiting("trainer", "PodInitializing")] if container == "preflight" else \
        [terminated("trainer", code, finished, reason)]
    cond = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": format_time(T0 + 1)}] + (conditions or [])
    return pod(phase="Failed", init=init, containers=app, conditions=cond, node=node, **kw)


def disruption(reason: str = "TerminationByKubelet") -> dict:
    """The DisruptionTarget condition a preemption, eviction, drain, node shutdown or node loss adds."""
    return {"type": "DisruptionTarget", "status": "True", "reason": reason, "lastTransitionTime": format_time(T0 + 70)}


def node(name: str, ready: bool = True, since: float = T0 - 86400, labels: dict | None = None,
         taints: list[dict] | None = None, gpus: int = 1, cordoned: bool = False) -> dict:
    """A Node as `kubectl get node -o json` shows it: labels, taints, allocatable (GPUs from the device plugin),
    its Ready condition since `since` (NotReady: Unknown, the node lifecycle controller's NodeStatusUnknown)."""
    ready_condition = {"type": "Ready", "status": "True" if ready else "Unknown",
                       "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                       "lastTransitionTime": format_time(since)}
    spec = {**({"taints": taints} if taints else {}), **({"unschedulable": True} if cordoned else {})}
    allocatable = {"cpu": "8", "memory": "32Gi", **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
            "spec": spec, "status": {"allocatable": allocatable, "conditions": [ready_condition]}}
