"""The trainer Job's outcome on a real cluster, modelled in the Job controller's own rule order (tests/k8s_model.py)
over the rendered manifests, the pod entry's exit codes and the start watchdog's decisions: a finished run
ends Complete whatever spares it spent; a preemption (torchrun's 1 or 143), a shrink or a deleted pod is not
counted; an OOM loop fails its index on backoffLimitPerIndex and the 4th the Job; no stop reaches the kubelet's
SIGKILL; a bad node costs one index, never the spares; a drought of capacity waits, for hours on spot, then fails
the Job once; a missing Secret fails the Job with its name. (What a run of weeks meets: tests/test_k8s_weeks.py.)

    python -m pytest -q tests/test_k8s_policy.py

(tests/test_k8s_placement.py checks placement and hardening; tests/test_k8s.py schema, checkov, flags.)
"""

from __future__ import annotations

import math
import signal

import pytest
from conftest import load_render
from k8s_manifests import argv, container, pod_spec, resolve_env, trainer_job
from k8s_model import BadNodeRun, JobModel, job_outcome, pod_rule
from k8s_pods import (
    SECRET_MISSING,
    T0,
    disruption,
    exited,
    mounting,
    stuck,
    terminated_after_delete,
    unschedulable,
)

from elastic_mnist.contract import exit_codes
from elastic_mnist.ops import pod as pod_entry
from elastic_mnist.ops import preflight, startrules, startwatch

render = load_render()
VARIANTS = render.overlays()
SINGLE_NODE = ("kind", "kind-gpu")
SPOT = ("gke", "eks", "aks")
TERM = signal.SIGTERM
HOURS = 3600


@pytest.fixture(scope="module")
def variants() -> dict[str, list[dict]]:
    return {name: render.render(name) for name in VARIANTS}


def _max_nodes(job: dict) -> int:
    return preflight.parse_launch(argv(job, container(job, "trainer"))[2:]).max_nodes


def _watchdog(docs: list[dict]):
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "startwatch")
    return startwatch.parse(argv(deployment, container(deployment, "startwatch"))[2:])


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_finished_run_completes_whatever_indexes_were_lost(variant, variants):
    """While the job runs, up to maxFailedIndexes indexes may have failed for good (a 4th fails the Job);
    when training finishes, up to --nnodes' maximum pods succeed in one sync. Every such sync ends Complete,
    and the lost indexes had spares (completions > the most pods that run)."""
    spec = trainer_job(variants[variant])["spec"]
    top = _max_nodes(trainer_job(variants[variant]))
    assert spec["maxFailedIndexes"] + top < spec["completions"]
    for failed in range(spec["maxFailedIndexes"] + 1):
        for succeeded in range(1, top + 1):
            assert job_outcome(spec, failed, succeeded) == "Complete", (failed, succeeded)
        assert job_outcome(spec, failed, 0) is None, "still running"
    assert job_outcome(spec, spec["maxFailedIndexes"] + 1, 0).startswith("Failed")


def test_the_controller_order_would_fail_a_finished_run_without_spares(variants):
    """The defect the spares avoid, in the same model: completions == parallelism == 2, one index lost
    and the other finishing is reported Failed, although training finished."""
    spec = dict(trainer_job(variants["kind"])["spec"], completions=2, maxFailedIndexes=None)
    assert job_outcome(spec, failed=1, succeeded=1) == "Failed: FailedIndexes"


def _stopped(code: int, *conditions: dict) -> dict:
    """The trainer container's exit after a stop, as `elastic-mnist pod` maps torchrun's code."""
    return exited("trainer", pod_entry.exit_code(code, TERM, finished=False), conditions=list(conditions))


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_preemption_a_shrink_or_a_deleted_pod_is_not_counted(variant, variants):
    """torchrun exits 1 on SIGTERM (SignalException), 143 if the signal came before its handlers, 137 if our
    stop deadline killed it: the pod entry makes each a 143, ignored with or without DisruptionTarget (a
    `kubectl delete pod` or a VM shut down outside the kubelet's graceful node shutdown has none). Plain
    torchrun's 1 without DisruptionTarget would be counted: the defect the pod entry's mapping removes. A
    shrink is never even matched: deleteJobPods (job_controller.go) removes the tracking finalizer first."""
    rules = trainer_job(variants[variant])["spec"]["podFailurePolicy"]["rules"]
    for torchrun_code in (exit_codes.FAILURE, exit_codes.killed_by(TERM), -TERM, exit_codes.killed_by(9)):
        assert pod_rule(rules, _stopped(torchrun_code))[1] == "Ignore", torchrun_code
        assert pod_rule(rules, _stopped(torchrun_code, disruption()))[1] == "Ignore"
    assert pod_rule(rules, exited("trainer", exit_codes.FAILURE)) == (None, "Count"), "plain torchrun"
    assert pod_rule(rules, exited("trainer", exit_codes.FAILURE, conditions=[disruption()]))[1] == "Ignore"
    assert pod_entry.exit_code(exit_codes.FAILURE, TERM, finished=True) == 0, "stopped at its end: succeeded"
    assert pod_entry.exit_code(exit_codes.PERMANENT, TERM, finished=False) == exit_codes.PERMANENT
    assert pod_entry.exit_code(exit_codes.FAILURE, None, finished=False) == exit_codes.FAILURE, "no stop: as is"


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_out_of_memory_loop_fails_its_index_on_the_limit_and_the_fourth_the_job(variant, variants):
    """Counted (a 137 may be a lost container, which a retry fixes): backoffLimitPerIndex bounds the loop."""
    spec = trainer_job(variants[variant])["spec"]
    model = JobModel(spec)
    for index in range(spec["maxFailedIndexes"] + 1):
        assert model.outcome() is None
        for _ in range(spec["backoffLimitPerIndex"] + 1):
            assert index not in model.failed
            assert model.pod_failed(index, exited("trainer", 137, reason="OOMKilled")) == "Count"
        assert index in model.failed
    assert model.outcome() == "Failed: MaxFailedIndexesExceeded"


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_stop_reaches_the_kubelets_sigkill(variant, variants):
    """137 after the grace period would read as an OOM (FailIndex). The budget: torchrun waits its shutdown
    timeout for the workers' save, then kills them; the pod entry drains the container's other processes;
    at ELASTIC_MNIST_STOP_S it kills what is left and exits 143, well before terminationGracePeriodSeconds.
    A pod killed after a grace period shortened by a node shutdown carries DisruptionTarget: ignored."""
    job = trainer_job(variants[variant])
    env, grace = resolve_env(job, container(job, "trainer")), pod_spec(job)["terminationGracePeriodSeconds"]
    shutdown, stop = float(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]), float(env["ELASTIC_MNIST_STOP_S"])
    assert stop == pod_entry.STOP_S and shutdown + pod_entry.DRAIN_S <= stop <= grace - 10
    assert shutdown <= grace / 2, "a save is bounded well below the grace period"
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert pod_rule(rules, _stopped(exit_codes.killed_by(9)))[1] == "Ignore", "our own deadline's kill"
    assert pod_rule(rules, exited("trainer", 137, conditions=[disruption()]))[1] == "Ignore"
    assert pod_rule(rules, exited("trainer", 137))[1] == "Count", "what a 137 means: OOM, a lost container"


def _ended(p: dict, verdict) -> dict:
    cond = {"type": verdict.condition, "status": "True", "reason": verdict.reason, "message": verdict.message}
    return terminated_after_delete(p, cond)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_missing_secret_fails_the_job_naming_it_or_waits_beside_running_trainers(variant, variants):
    """Mounted as a volume, a missing Secret leaves the pod in Init:0/1 (PodInitializing) with FailedMount
    events only. With no trainer running: after the deadline the Job fails (FailJob) and the pod's condition
    names the Secret; while trainers run it is reported, the Job goes on."""
    docs = variants[variant]
    opts, spec = _watchdog(docs), trainer_job(docs)["spec"]
    p, now = mounting(), T0 + 2 + opts.deadline
    verdict = startrules.decide(p, now, opts, T0, [SECRET_MISSING], frozenset())
    assert 'secret "elastic-mnist-etcd" not found' in verdict.message
    model = JobModel(spec)
    assert model.pod_failed(0, _ended(p, verdict)) == "FailJob" and model.outcome() == "Failed: PodFailurePolicy"
    beside = startrules.decide(p, now, opts, now - 30, [SECRET_MISSING], frozenset())
    assert (beside.condition, beside.end) == (startrules.WAITING, False), "a running job is not ended"
    plain = terminated_after_delete(p, None)  # a `kubectl delete pod` of the stuck pod instead
    assert pod_rule(spec["podFailurePolicy"]["rules"], plain)[1] in ("Count", "Ignore")


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_drought_of_capacity_waits_then_fails_the_job_once(variant, variants):
    """Every index unschedulable at parallelism 4, no trainer running. Reported meanwhile; then one CannotStart fails
    the Job with the scheduler's words, never `parallelism` FailIndex at once: after 30 minutes where the cluster
    cannot grow, after 4 hours on spot (capacity comes back; a waiting pod holds no GPU). Never for ever."""
    docs = variants[variant]
    opts, spec = _watchdog(docs), dict(trainer_job(docs)["spec"], parallelism=4)
    model = JobModel(spec)
    for now in range(0, 12 * HOURS, int(opts.interval)):
        verdicts = [startrules.decide(unschedulable(name=f"trainer-{i}-p"), T0 + now, opts, T0, [], frozenset())
                    for i in model.pending(set(), spec["parallelism"])]
        for index, v in zip(model.pending(set(), spec["parallelism"]), verdicts):
            if v and v.end:
                model.pod_failed(index, _ended(unschedulable(), v))
        if model.outcome():
            break
    assert model.outcome() == "Failed: PodFailurePolicy" and not model.failed
    assert now == math.ceil(opts.pending_deadline / opts.interval) * opts.interval
    assert now == (4 * HOURS if variant in SPOT else 1800)
    assert "Insufficient nvidia.com/gpu" in verdicts[0].message


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_bad_image_everywhere_fails_the_job_in_bounded_time_and_one_node_costs_one_index(variant, variants):
    """Every pod stuck: each round the watchdog fails `parallelism` indexes (FailIndex) and the spares
    start; the 4th fails the Job with MaxFailedIndexesExceeded after ceil(4 / parallelism) deadlines.
    One node's pull problem costs one index and a finished run still ends Complete."""
    docs = variants[variant]
    spec, opts = trainer_job(docs)["spec"], _watchdog(docs)
    p = stuck("ImagePullBackOff")
    ended = _ended(p, startrules.decide(p, T0 + 2 + opts.deadline, opts, T0 - HOURS, [], frozenset()))
    model, rounds = JobModel(spec), 0
    while model.outcome() is None:
        for index in model.pending(set(), spec["parallelism"]):
            assert model.pod_failed(index, ended) == "FailIndex"
        rounds += 1
    assert model.outcome() == "Failed: MaxFailedIndexesExceeded"
    assert rounds == math.ceil((spec["maxFailedIndexes"] + 1) / spec["parallelism"]) == 2
    assert job_outcome(spec, failed=1, succeeded=spec["parallelism"]) == "Complete"


MULTI_NODE = [v for v in VARIANTS if v not in SINGLE_NODE]


@pytest.mark.parametrize("parallelism", [2, 4])
@pytest.mark.parametrize("variant", MULTI_NODE)
def test_a_bad_node_costs_one_index_and_the_trainers_go_elsewhere(variant, parallelism, variants):
    """A node whose preflight exits 69, the scheduler steering every replacement to it while it is free: the
    watchdog marks it, the affinity keeps replacements off it, a replacement already placed there is ended
    uncounted. Whatever the phase of the sweeps: one index lost, the job at full size on good nodes, and a
    finished run Complete."""
    docs = variants[variant]
    job, opts = trainer_job(docs), _watchdog(docs)
    for phase in range(int(opts.interval)):
        run = BadNodeRun(job, opts, nodes=parallelism + 2, parallelism=parallelism)
        assert run.run(seconds=int(20 * opts.interval), phase=phase) is None, (phase, run.failures)
        assert [node for _, node in run.failures] == ["n0"], (phase, run.failures)
        assert sorted(t.node for t in run.training()) == [f"n{i}" for i in range(1, parallelism + 1)]
        assert job_outcome(run.model.spec, len(run.model.failed), parallelism) == "Complete"


@pytest.mark.parametrize("variant", ["gke"])
def test_without_the_mark_or_the_hold_one_bad_node_burns_the_spares(variant, variants):
    """The defect, in the same model: no mark (the old manifests) and the replacements fail on the one bad
    node until the Job does; a mark without preflight's hold loses the race for some sweep phases."""
    docs = variants[variant]
    job, opts = trainer_job(docs), _watchdog(docs)
    unmarked = BadNodeRun(job, startwatch.parse([*_args(docs), "--avoid-label="]), nodes=4)
    unmarked.terms = []
    assert unmarked.run(seconds=int(20 * opts.interval), phase=0) == "Failed: MaxFailedIndexesExceeded"
    assert {node for _, node in unmarked.failures} == {"n0"}
    lost = []
    for phase in range(int(opts.interval)):
        run = BadNodeRun(job, opts, nodes=4)
        run.hold = 0
        run.run(seconds=int(20 * opts.interval), phase=phase)
        lost.append(len(run.failures))
    assert max(lost) >= 2, lost


def _args(docs: list[dict]) -> list[str]:
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "startwatch")
    return argv(deployment, container(deployment, "startwatch"))[2:]


@pytest.mark.parametrize("variant", SINGLE_NODE)
def test_on_one_node_a_node_local_failure_just_fails_its_index(variant, variants):
    """No mark (it would leave every trainer Pending on the only node), no hold: the index fails at once and
    the 4th the Job, with preflight's line on each pod."""
    docs = variants[variant]
    job, opts = trainer_job(docs), _watchdog(docs)
    assert not opts.avoid_label
    run = BadNodeRun(job, opts, nodes=1)
    assert run.hold == 0
    assert run.run(seconds=600, phase=0) == "Failed: MaxFailedIndexesExceeded" and len(run.failures) == 4


@pytest.mark.parametrize("given", [["--max-restarts=100"], ["--max-restarts", "3"], ["--max_restarts=0"], []])
def test_a_pods_restarts_are_limited_by_rate_not_by_a_lifetime_count(given):
    """Under etcd-v3 the pod hands torchrun a budget no run reaches; the backend's crash rate ends a node."""
    args = ["--nnodes=1:4", *given, "--rdzv-backend=etcd-v3", "--monitor-interval=0.1"]
    assert pod_entry.rate_limited(args) == ["--nnodes=1:4", "--rdzv-backend=etcd-v3", "--monitor-interval=0.1",
                                      f"--max-restarts={pod_entry.POD_MAX_RESTARTS}"]
