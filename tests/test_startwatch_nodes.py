"""The start watchdog's decisions that need the nodes: which nodes could take a trainer but for the marks (the
scheduler's node filters: cordon, selector and required affinity, taints, extended resources), the Job failed when
every such node is marked (only after --marked-deadline with no trainer running: an autoscaler's time), and a pod
that its NotReady node will never end.

    python -m pytest -q tests/test_startwatch_nodes.py
"""

from __future__ import annotations

import pytest
from k8s_pods import T0, node, pod, running, terminated, unschedulable
from startwatch_opts import LABEL, OPTS, options, verdict

from elastic_mnist.ops import noderules
from elastic_mnist.ops.noderules import feasible_nodes
from elastic_mnist.ops.startrules import CANNOT_START, NODE_LOST, WAITING

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
SPOT_TAINT = {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}


def trainer(**kw) -> dict:
    """An unschedulable trainer pod with the spec that matters here: the mark's term, a pool label, the GPU."""
    p = unschedulable(**kw)
    p["spec"] = {
        "nodeSelector": {"pool": "gpu"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": LABEL, "operator": "DoesNotExist"}]}]}}},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
                         "tolerationSeconds": 30}],
        "containers": [{"name": "trainer", "resources": {"requests": {"cpu": "2", "nvidia.com/gpu": 1}}}]}
    return p


def test_the_nodes_that_could_take_a_trainer_are_the_schedulers_filters_without_the_mark():
    gpu = {"pool": "gpu"}
    nodes = [node("ok", labels=gpu, taints=[GPU_TAINT]),
             node("marked", labels={**gpu, LABEL: "1796140800"}, taints=[GPU_TAINT]),
             node("no-gpu", labels=gpu, gpus=0),
             node("other-pool", labels={"pool": "cpu"}),
             node("cordoned", labels=gpu, cordoned=True),
             node("spot-taint", labels=gpu, taints=[GPU_TAINT, SPOT_TAINT]),
             node("not-ready", labels=gpu, ready=False,
                  taints=[{"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
                          {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]),
             node("prefer-no-schedule", labels=gpu, taints=[{"key": "x", "effect": "PreferNoSchedule"}])]
    assert feasible_nodes(trainer(), nodes, LABEL) == {"ok", "marked", "prefer-no-schedule"}
    assert feasible_nodes(trainer(), nodes, "") == {"ok", "prefer-no-schedule"}, "the mark's term counts without it"


@pytest.mark.parametrize("operator,values,value,expected", [
    ("In", ["a", "b"], "b", True), ("NotIn", ["a"], "a", False), ("Exists", [], "x", True),
    ("DoesNotExist", [], "x", False), ("Gt", ["4"], "8", True), ("Lt", ["4"], "8", False), ("In", ["a"], None, False)])
def test_node_affinity_operators(operator, values, value, expected):
    p = trainer()
    p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] = [
        {"matchExpressions": [{"key": "k", "operator": operator, "values": values}]}]
    labels = {"pool": "gpu", **({"k": value} if value is not None else {})}
    assert (feasible_nodes(p, [node("n", labels=labels)], LABEL) == {"n"}) is expected


def test_the_job_fails_when_every_node_that_could_take_a_trainer_is_marked_after_the_marked_deadline():
    """An autoscaler gets --marked-deadline to add an unmarked node; a trainer running anywhere means the job runs
    smaller, which is not ended; a node that could take it unmarked means the pod waits for its turn."""
    p, marked = trainer(), frozenset({"a", "b"})
    deadline = OPTS.marked_deadline
    assert deadline == 900
    v = verdict(p, T0 + deadline, peers_ran_at=T0 - 86400, marked=marked, feasible=frozenset({"a", "b"}))
    assert (v.condition, v.reason, v.end) == (CANNOT_START, "EveryNodeMarked", True)
    assert "every node that could take a trainer (a, b) is marked" in v.message and "kubectl label node" in v.message
    early = verdict(p, T0 + deadline - 1, peers_ran_at=T0 - 86400, marked=marked, feasible=frozenset({"a", "b"}))
    assert early is None or early.condition == WAITING
    running_peer = verdict(p, T0 + 86400, peers_ran_at=T0 + 86400, marked=marked, feasible=frozenset({"a"}))
    assert running_peer.condition == WAITING, "trainers run: reported only"
    free = verdict(p, T0 + deadline + 60, peers_ran_at=T0 - 86400, marked=marked, feasible=frozenset({"a", "c"}))
    assert free.condition == WAITING, "an unmarked node could take it"
    for feasible in (None, frozenset()):  # nodes not listed; no node at all (a pool scaled to zero: capacity)
        assert verdict(p, T0 + deadline + 60, peers_ran_at=T0 - 86400, marked=marked, feasible=feasible).condition \
            == WAITING
    off = options("--marked-deadline=0")
    assert verdict(p, T0 + deadline + 60, T0 - 86400, off, marked=marked, feasible=marked).condition == WAITING


def test_a_lost_pod_is_released_only_past_the_bound_on_a_node_that_stays_not_ready():
    p = pod(phase="Running", deleting=True, init=[terminated("preflight", 0, T0 + 20)],
            containers=[running("trainer", T0 + 21)])
    end = T0 + 3600  # its deletionTimestamp: when its grace period ended
    down = node("gpu-node-1", ready=False, since=end - 400)
    v = noderules.lost(p, down, end + 300, 300)
    assert (v.condition, v.reason, v.end, v.waited) == (NODE_LOST, "NodeLost", True, 300)
    assert "kubectl delete node gpu-node-1" in v.message and "NodeStatusUnknown" in v.message
    assert noderules.lost(p, down, end + 299, 300) is None, "within the bound"
    assert noderules.lost(p, node("gpu-node-1", ready=False, since=end + 1), end + 300, 300) is None, "NotReady anew"
    assert noderules.lost(p, node("gpu-node-1"), end + 3000, 300) is None, "its kubelet answers: it ends the pod"
    assert noderules.lost(p, None, end + 3000, 300) is None, "the Node is gone: the pod GC's own case"
    assert noderules.lost(p, down, end + 3000, 0) is None, "turned off"
    done = dict(p, status=dict(p["status"], phase="Failed"))
    assert noderules.lost(done, down, end + 3000, 300) is None, "terminal already"
