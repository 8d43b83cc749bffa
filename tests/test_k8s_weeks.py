"""What a run of weeks meets, in the Job controller's, the scheduler's and the start watchdog's own rules
(tests/k8s_model.py) over the rendered manifests: every GPU node marked, a node NotReady for good, a GPU that fails
at run time, a 137 that is not an out-of-memory kill, and the per-index backoff of a much-preempted index.

    python -m pytest -q tests/test_k8s_weeks.py
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from conftest import load_render
from k8s_manifests import argv, container, pod_spec, resolve_env, trainer_job
from k8s_model import MAX_POD_FAILURE_BACKOFF_S, BadNodeRun, JobModel, index_backoff
from k8s_pods import T0, disruption, exited, node, pod, running, terminated, terminated_after_delete, unschedulable

from elastic_mnist.contract import exit_codes
from elastic_mnist.ops import noderules, startrules, startwatch
from elastic_mnist.ops import pod as pod_entry
from elastic_mnist.worker.devicefault import device_fault

REPO = Path(__file__).resolve().parent.parent
DOCS = " ".join((REPO / "docs" / "kubernetes.md").read_text().split())

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


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} minutes"


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_much_preempted_index_comes_back_minutes_late_and_the_docs_say_after_how_many(variant, variants):
    """The Job controller backs an index off by its absolute failure count, ignored failures included: preemptions
    are never counted against backoffLimitPerIndex, yet each one doubles the wait before the index's next pod, up
    to 10 minutes. Nothing in the manifests changes that (an Ignore rule still adds to the ignored count); the
    docs give the numbers."""
    spec = trainer_job(variants[variant])["spec"]
    model, delays = JobModel(spec), []
    for _ in range(12):
        preempted = exited("trainer", exit_codes.killed_by(15), conditions=[disruption("EvictionByEvictionAPI")])
        assert model.pod_failed(0, preempted) == "Ignore"
        delays.append(model.replacement_delay(0))
    assert not model.counted and not model.failed, "never counted, never fails the index"
    assert delays[:7] == [10, 20, 40, 80, 160, 320, 600] and set(delays[6:]) == {MAX_POD_FAILURE_BACKOFF_S}
    minute_late = next(n for n, d in enumerate(delays, 1) if d >= 60)
    capped = next(n for n, d in enumerate(delays, 1) if d == MAX_POD_FAILURE_BACKOFF_S)
    assert (minute_late, capped) == (4, 7)
    assert (f"the {minute_late}th disruption of an index delays its next pod by {delays[minute_late - 1]:.0f} s, "
            f"the {capped}th and every later one by {_minutes(delays[capped - 1])}") in DOCS
    assert index_backoff(0) == 10 and index_backoff(40) == MAX_POD_FAILURE_BACKOFF_S


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_137_without_disruption_target_retries_its_index_and_an_oom_loop_is_bounded(variant, variants):
    """A node back under the same name reports its lost container as ContainerStatusUnknown, 137, with no
    DisruptionTarget: counted and retried, never the index lost. A real OOM loop is bounded by backoffLimitPerIndex:
    the 11th kill fails the index, after the Job controller's backoff between the kills; the docs give the time."""
    spec = trainer_job(variants[variant])["spec"]
    model = JobModel(spec)
    lost = exited("trainer", 137, reason="ContainerStatusUnknown")
    assert model.pod_failed(0, lost) == "Count" and not model.failed and model.replacement_delay(0) == 10
    assert model.pod_failed(1, exited("trainer", 137, reason="ContainerStatusUnknown",
                                      conditions=[disruption("DeletionByTaintManager")])) == "Ignore"
    oom, model, waits, kills = exited("trainer", 137, reason="OOMKilled"), JobModel(spec), 0.0, 0
    while 0 not in model.failed:
        kills += 1
        assert model.pod_failed(0, oom) == "Count"
        waits += 0 if 0 in model.failed else model.replacement_delay(0)
    assert kills == spec["backoffLimitPerIndex"] + 1 == 11 and waits == 3030
    parallel_rounds = -(-(spec["maxFailedIndexes"] + 1) // spec["parallelism"])  # two at parallelism 2
    assert (f"the {kills}th kill of an index fails it, after {_minutes(waits)} of the Job controller's backoff" in DOCS
            and f"{parallel_rounds * kills * spec['parallelism']} pods and {_minutes(parallel_rounds * waits)}" in DOCS)


@pytest.mark.parametrize("variant", ["gke"])
def test_a_watchdog_that_misses_its_sweeps_costs_an_index_per_hold_it_misses(variant, variants):
    """The mark is not guaranteed to come within a replacement's hold (75 s, two sweeps): while the watchdog is
    down, each replacement the scheduler steers to the bad node fails there too. The mark still comes with its
    first pass (failed pods stay listed), and from then on no more index is lost there."""
    docs = variants[variant]
    job, opts = trainer_job(docs), _watchdog(docs)
    lost = {}
    for down in (0, 150, 240, 300):  # the first exit 69 at 77 s, each replacement's 77 s later
        run = BadNodeRun(job, opts, nodes=4)
        outcome = run.run(seconds=int(40 * opts.interval), phase=0, down_until=down)
        lost[down] = (len(run.failures), outcome)
        assert {node for _, node in run.failures} == {"n0"}
    assert lost[0] == (1, None), "the watchdog in time: one index"
    assert lost[150] == (2, None) and lost[240] == (3, None), "each hold missed: one more"
    assert lost[300] == (4, "Failed: MaxFailedIndexesExceeded"), "down for four holds: the Job"
    assert "each 75 s hold it misses costs one more index" in DOCS


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_gpu_that_fails_at_run_time_fails_its_index_marks_its_node_and_the_job_goes_on(variant, variants):
    """An uncorrectable ECC error in a step: the worker ends its node (69, tests/test_devicefault.py), the pod exits
    69 after its hold, its index fails (a spare takes the place), the watchdog marks the node (not on one node),
    the Job runs on."""
    docs = variants[variant]
    job, opts = trainer_job(docs), _watchdog(docs)
    assert device_fault(RuntimeError("CUDA error: uncorrectable ECC error encountered"))
    code = pod_entry.exit_code(exit_codes.NODE_LOCAL, None, finished=False)
    failed = exited("trainer", code, node="gpu-3", reason="Error")
    model = JobModel(job["spec"])
    assert model.pod_failed(1, failed) == "FailIndex" and model.outcome() is None
    assert model.pending({0}, 1) == [2], "the next spare index takes the place"
    if variant in SINGLE_NODE:
        assert not opts.avoid_label
        return
    assert startrules.node_local_failure(failed, opts.node_local_exit), "the node is marked"
    hold = float(resolve_env(job, container(job, "trainer"))["ELASTIC_MNIST_NODE_LOCAL_HOLD_S"])
    assert hold >= 2 * opts.interval


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_trainer_on_a_node_that_never_returns_is_replaced_uncounted_in_about_8_minutes(variant, variants):
    """The taint-eviction controller deletes the pod (DisruptionTarget) once the trainers' toleration is over; the
    pod stays non-terminal while its node is NotReady. The watchdog makes it Failed with NodeLost after
    --node-lost-after: ignored by the Job, with DisruptionTarget or without (a pod deleted by hand before)."""
    docs = variants[variant]
    job, opts = trainer_job(docs), _watchdog(docs)
    if variant in SINGLE_NODE:
        assert opts.node_lost_after == 0, "no node read on one node"
        return
    spec = pod_spec(job)
    unreachable = "node.kubernetes.io/unreachable"
    (toleration,) = [t["tolerationSeconds"] for t in spec["tolerations"] if t["key"] == unreachable]
    grace, monitor_grace = spec["terminationGracePeriodSeconds"], 50
    p = pod(phase="Running", deleting=True, init=[terminated("preflight", 0, T0 + 20)],
            containers=[running("trainer", T0 + 21)])
    end = T0 + 3600  # deletionTimestamp: the end of the grace period
    silent = end - grace - toleration - monitor_grace  # when the node stopped answering
    down = node("gpu-node-1", ready=False, since=silent + monitor_grace)
    first = next(t for t in range(int(end), int(end) + 3600, int(opts.interval))
                 if noderules.lost(p, down, t, opts.node_lost_after))
    released = first - silent
    assert released == monitor_grace + toleration + grace + opts.node_lost_after
    assert round((released + opts.interval) / 60) == 8 and "replaced about 8 minutes after its node" in DOCS
    v = noderules.lost(p, down, first, opts.node_lost_after)
    condition = {"type": v.condition, "status": "True", "reason": v.reason}
    for extra in ([], [disruption("DeletionByTaintManager")]):
        made_failed = dict(p, status=dict(p["status"], phase="Failed",
                                          conditions=p["status"]["conditions"] + extra + [condition]))
        assert JobModel(job["spec"]).pod_failed(0, made_failed) == "Ignore"
