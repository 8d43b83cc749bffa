"""What a run of weeks meets, in the Job controller's, the scheduler's and the start watchdog's own rules
(tests/k8s_model.py) over the rendered manifests: every GPU node marked, a node NotReady for good, a GPU that fails
at run time, a 137 that is not an out-of-memory kill, and the per-index backoff of a much-preempted index.

    python -m pytest -q tests/test_k8s_weeks.py
"""

from __future__ import annotations

import copy

import pytest
from conftest import load_render
from k8s_manifests import argv, container, pod_spec, trainer_job
from k8s_model import JobModel
from k8s_pods import T0, node, terminated_after_delete, unschedulable

from elastic_mnist.ops import noderules, startrules, startwatch

render = load_render()
VARIANTS = render.overlays()
SINGLE_NODE = ("kind", "kind-gpu")
HOURS = 3600


@pytest.fixture(scope="module")
def variants() -> dict[str, list[dict]]:
    return {name: render.render(name) for name in VARIANTS}


def _watchdog(docs: list[dict]):
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "startwatch")
    return startwatch.parse(argv(deployment, container(deployment, "startwatch"))[2:])


def _ended(p: dict, verdict) -> dict:
    cond = {"type": verdict.condition, "status": "True", "reason": verdict.reason, "message": verdict.message}
    return terminated_after_delete(p, cond)


def _gpu_node(name: str, job: dict, variant: str, marked: bool) -> dict:
    """A node of the variant's GPU pool as its cloud labels and taints it, the device plugin's GPU on it."""
    spot = {"gke": ({"cloud.google.com/gke-spot": "true"}, [{"key": "cloud.google.com/gke-spot", "value": "true",
                                                           "effect": "NoSchedule"}]),
            "aks": ({"kubernetes.azure.com/scalesetpriority": "spot"},
                    [{"key": "kubernetes.azure.com/scalesetpriority", "value": "spot", "effect": "NoSchedule"}]),
            "eks": ({"karpenter.sh/capacity-type": "spot"}, [])}
    labels, taints = spot.get(variant, ({}, []))
    if marked:
        labels = {**labels, _watchdog_label(job): str(int(T0))}
    return node(name, labels=labels, taints=taints + [{"key": "nvidia.com/gpu", "value": "present",
                                                        "effect": "NoSchedule"}])


def _watchdog_label(job: dict) -> str:
    return f"avoid.elastic-mnist.io/{job['spec']['template']['metadata']['labels']['app.kubernetes.io/instance']}"


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v not in SINGLE_NODE])
def test_every_gpu_node_marked_fails_the_job_in_minutes_not_hours(variant, variants):
    """Three GPU nodes, each marked after a trainer failed there: the pod of the rendered Job cannot be placed. An
    autoscaler gets --marked-deadline to add an unmarked node; then the Job fails (FailJob) naming the nodes,
    instead of waiting the 6 hours a mark lasts (or the spot variants' 4 hours)."""
    docs = variants[variant]
    job, opts = trainer_job(docs), _watchdog(docs)
    p = unschedulable(message="0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector.")
    p["spec"] = copy.deepcopy(pod_spec(job))
    nodes = [_gpu_node(f"gpu-{i}", job, variant, marked=True) for i in range(3)]
    marked = frozenset(n["metadata"]["name"] for n in nodes if opts.avoid_label in n["metadata"]["labels"])
    feasible = noderules.feasible_nodes(p, nodes, opts.avoid_label)
    assert feasible == marked == {"gpu-0", "gpu-1", "gpu-2"}
    assert startrules.needs_nodes([p], T0 + opts.marked_deadline, opts, T0 - HOURS)
    v = startrules.decide(p, T0 + opts.marked_deadline, opts, T0 - HOURS, [], marked, feasible)
    assert (v.condition, v.reason) == (startrules.CANNOT_START, "EveryNodeMarked")
    assert "gpu-0, gpu-1, gpu-2" in v.message
    model = JobModel(job["spec"])
    assert model.pod_failed(0, _ended(p, v)) == "FailJob" and model.outcome() == "Failed: PodFailurePolicy"
    assert opts.marked_deadline < opts.pending_deadline <= 4 * HOURS < opts.avoid_for
    grown = nodes + [_gpu_node("gpu-new", job, variant, marked=False)]  # what an autoscaler adds: no mark
    assert noderules.feasible_nodes(p, grown, opts.avoid_label) - marked == {"gpu-new"}
    later = startrules.decide(p, T0 + opts.marked_deadline, opts, T0 - HOURS, [], marked,
                              noderules.feasible_nodes(p, grown, opts.avoid_label))
    assert later.condition == startrules.WAITING, "a node it can take: it waits for the scheduler"
