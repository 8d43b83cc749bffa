"""The start watchdog's decisions that need the cluster's nodes: which nodes could take a trainer but for the marks
(so that a job whose every such node is marked fails instead of waiting for hours), and a trainer pod that its node
will never end (a node NotReady for good). Pure functions of the API's objects, like startrules.py.

    from elastic_mnist.ops import noderules; noderules.feasible_nodes(pod, nodes, "avoid.elastic-mnist.io/mnist")

Standard library only.
"""

from __future__ import annotations

from elastic_mnist.ops.startrules import NODE_LOST, Verdict, condition_of, parse_time

_SCHEDULING_EFFECTS = ("NoSchedule", "NoExecute")


def feasible_nodes(pod: dict, nodes: list[dict], mark: str) -> frozenset[str]:
    """The nodes that could take this pod if none were marked: schedulable (not cordoned), matching its nodeSelector
    and required node affinity (without the terms on the mark), every NoSchedule/NoExecute taint tolerated, and
    each extended resource it requests (nvidia.com/gpu) in the node's allocatable. What the scheduler's filters
    check of the node itself (pkg/scheduler/framework/plugins: nodeunschedulable, nodeaffinity, tainttoleration,
    noderesources); what other pods use of it is not counted: the question is whether the node could ever serve."""
    spec = pod.get("spec", {})
    return frozenset(n["metadata"]["name"] for n in nodes
                     if not n.get("spec", {}).get("unschedulable") and _selects(spec, n, mark)
                     and _tolerated(spec.get("tolerations", []), n.get("spec", {}).get("taints", []))
                     and _fits(spec, n))


def _selects(spec: dict, node: dict, mark: str) -> bool:
    labels = node["metadata"].get("labels", {})
    if any(labels.get(k) != v for k, v in spec.get("nodeSelector", {}).items()):
        return False
    required = spec.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    terms = (required or {}).get("nodeSelectorTerms", [])
    return not terms or any(_term(t, labels, node["metadata"]["name"], mark) for t in terms)


def _term(term: dict, labels: dict, name: str, mark: str) -> bool:
    """One nodeSelectorTerm: its expressions ANDed (k8s.io/component-helpers/scheduling/corev1/nodeaffinity)."""
    fields = {"metadata.name": name}
    return all(_matches(e, labels, mark) for e in term.get("matchExpressions", [])) and \
        all(_matches(e, fields, "") for e in term.get("matchFields", []))


def _matches(e: dict, labels: dict, mark: str) -> bool:
    if e["key"] == mark:
        return True  # the mark's own term: the question is what the node would be without it
    value, values = labels.get(e["key"]), e.get("values", [])
    return {"In": lambda: value in values, "NotIn": lambda: value not in values,
            "Exists": lambda: e["key"] in labels, "DoesNotExist": lambda: e["key"] not in labels,
            "Gt": lambda: value is not None and value.isdigit() and int(value) > int(values[0]),
            "Lt": lambda: value is not None and value.isdigit() and int(value) < int(values[0])}[e["operator"]]()


def _tolerated(tolerations: list[dict], taints: list[dict]) -> bool:
    return all(any(_tolerates(t, taint) for t in tolerations)
               for taint in taints if taint.get("effect") in _SCHEDULING_EFFECTS)


def _tolerates(t: dict, taint: dict) -> bool:
    """v1.Toleration.ToleratesTaint (k8s.io/api/core/v1/toleration.go)."""
    if t.get("effect") and t["effect"] != taint.get("effect"):
        return False
    if t.get("key") and t["key"] != taint.get("key"):
        return False
    if t.get("operator") == "Exists":
        return True
    return t.get("value", "") == taint.get("value", "")


def _fits(spec: dict, node: dict) -> bool:
    allocatable = node.get("status", {}).get("allocatable", {})
    wanted: dict[str, int] = {}
    for c in spec.get("containers", []):
        for name, quantity in c.get("resources", {}).get("requests", {}).items():
            if "/" in name and not name.startswith(("kubernetes.io/", "hugepages-")):
                wanted[name] = wanted.get(name, 0) + int(quantity)
    return all(str(allocatable.get(name, "0")).isdigit() and int(allocatable.get(name, "0")) >= n
               for name, n in wanted.items())


def lost(pod: dict, node: dict | None, now: float, after: float) -> Verdict | None:
    """A trainer pod whose end its kubelet never confirms: deleted (the taint-eviction controller deletes it 30 s
    into a NotReady node, the trainers' toleration) and still not terminal `after` seconds past its grace period,
    on a node that has not been Ready for as long. The pod GC does the same only once the Node object is gone
    (gcOrphaned) or carries the out-of-service taint (gcTerminating); until then, with podReplacementPolicy: Failed,
    the index is not replaced at all. None when the node is gone (the pod GC's own case) or answers."""
    deleted = parse_time(pod["metadata"].get("deletionTimestamp"))
    if after <= 0 or deleted is None or node is None or now - deleted < after:
        return None
    if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
        return None
    ready = condition_of(node, "Ready")
    since = parse_time(ready.get("lastTransitionTime"))
    if ready.get("status") == "True" or since is None or now - since < after:
        return None
    name = node["metadata"]["name"]
    return Verdict(NODE_LOST, "NodeLost", now - deleted,
                   f"node {name} has not been Ready for {now - since:.0f}s ({ready.get('reason', 'no status')}) and "
                   f"never confirmed this pod's end, {now - deleted:.0f}s after its grace period: marked Failed and "
                   "removed (as the pod garbage collector does on a node out of service), so that its index starts "
                   f"elsewhere. The node itself is untouched: repair or delete it (kubectl delete node {name})")
