"""The start watchdog's decisions on real pod and event objects.

    python -m pytest -q tests/test_startwatch.py

(tests/test_startwatch_api.py checks the requests it sends and a sweep; tests/test_startwatch_nodes.py its
decisions that need the nodes; tests/test_startwatch_k8s.py its manifests; tests/test_k8s_policy.py what the Job
makes of the pod.)
"""

from __future__ import annotations

import re

import pytest
from k8s_pods import (
    KEY_MISSING,
    MOUNT_TIMEOUT,
    SECRET_MISSING,
    T0,
    exited,
    mount_event,
    mounting,
    pod,
    running,
    stuck,
    terminated,
    unschedulable,
    waiting,
)
from startwatch_opts import DEADLINE, FAR, LABEL, OPTS, PENDING, SPOT, options, verdict

from elastic_mnist.ops import startrules
from elastic_mnist.ops.startrules import (
    CANNOT_START,
    IMAGE_REASONS,
    NODE_AVOIDED,
    NODE_MARKED,
    STUCK,
    WAITING,
)


@pytest.mark.parametrize("reason", sorted(IMAGE_REASONS))
@pytest.mark.parametrize("where", ["preflight", "trainer"])
def test_an_image_error_fails_the_index_exactly_at_the_deadline(reason, where):
    """Counted from the pod's start (preflight) or from the end of the init container before it (trainer):
    one second short of the deadline nothing happens, at the deadline the pod is ended."""
    p = stuck(reason, where, message='Back-off pulling image "elastic-mnist:0.1.0"')
    since = T0 + 2 if where == "preflight" else T0 + 60
    assert verdict(p, since + DEADLINE - 1) is None
    v = verdict(p, since + DEADLINE, peers_ran_at=since + DEADLINE)  # whether trainers run does not matter
    assert (v.condition, v.reason, v.waited, v.end) == (STUCK, reason, DEADLINE, True)
    assert f"waited 900s: container {where} in {reason}" in v.message and "cannot be pulled on this node" in v.message
    assert f'{reason} (Back-off pulling image "elastic-mnist:0.1.0"): ' in v.message, "the kubelet's own words"
    assert f"in {reason}: " in verdict(stuck(reason, where), since + DEADLINE).message, "no empty parentheses"


@pytest.mark.parametrize("case", ["secret", "key", "env"])
def test_a_missing_object_fails_the_job_only_when_no_trainer_runs_and_names_the_object(case):
    """A Secret mounted as a volume: the pod waits in PodInitializing with nothing but FailedMount events;
    read from an env var: CreateContainerConfigError. After the deadline with no trainer running: CannotStart
    (FailJob), the object named; while trainers run: reported, not ended."""
    if case == "env":
        p, mounts = stuck("CreateContainerConfigError", "trainer", message='secret "elastic-mnist-etcd" not found'), []
        since = T0 + 60
    else:
        p, since = mounting(), T0 + 2
        mounts = [mount_event(p, SECRET_MISSING if case == "secret" else KEY_MISSING, FAR)["message"]]
    assert verdict(p, since + DEADLINE - 1, mounts=mounts) is None
    v = verdict(p, since + DEADLINE, mounts=mounts)
    assert (v.condition, v.end) == (CANNOT_START, True) and "create the missing object" in v.message
    named = {"secret": 'secret "elastic-mnist-etcd" not found', "key": "non-existent secret key: rdzv-secret",
             "env": 'secret "elastic-mnist-etcd" not found'}[case]
    assert named in v.message, v.message
    reported = verdict(p, since + DEADLINE, peers_ran_at=since + DEADLINE - 60, mounts=mounts)
    assert (reported.condition, reported.end) == (WAITING, False) and named in reported.message


def test_a_volume_that_does_not_mount_on_this_node_fails_the_index():
    p = mounting()
    v = verdict(p, T0 + 2 + DEADLINE, peers_ran_at=FAR, mounts=[MOUNT_TIMEOUT])
    assert (v.condition, v.reason) == (STUCK, "FailedMount") and "DeadlineExceeded" in v.message
    assert verdict(p, FAR) is None, "PodInitializing without a FailedMount event is only slow"


def test_only_fresh_failed_mount_events_of_the_pod_count():
    p, other = mounting(), mounting(name="trainer-1-b2", uid="u-other")
    events = [mount_event(p, "old", FAR - startrules.EVENT_FRESH_S - 1), mount_event(p, SECRET_MISSING, FAR - 5),
              mount_event(other, MOUNT_TIMEOUT, FAR)]
    assert startrules.mount_messages(events, FAR) == {p["metadata"]["uid"]: [SECRET_MISSING],
                                                      "u-other": [MOUNT_TIMEOUT]}


@pytest.mark.parametrize("reason", ["ContainerCreating", "PodInitializing", "CrashLoopBackOff", "CreateContainerError"])
def test_slow_or_other_waits_are_never_ended(reason):
    """A slow pull of a big image is ContainerCreating; those and runtime errors are not this watchdog's."""
    assert verdict(stuck(reason), FAR, peers_ran_at=T0 - 86400) is None


def test_just_started_running_terminal_and_deleting_pods_are_left_alone():
    assert verdict(stuck("ImagePullBackOff"), T0 + 30) is None, "just started"
    live = pod(phase="Running", init=[terminated("preflight", 0, T0 + 20)], containers=[running("trainer", T0 + 21)])
    assert verdict(live, FAR) is None
    assert verdict(live, FAR, marked={"gpu-node-1"}) is None, "a mark never ends a running trainer"
    for phase in ("Succeeded", "Failed"):
        assert verdict(pod(phase=phase, init=[waiting("preflight", "ErrImagePull")]), FAR) is None, phase
    assert verdict(stuck("ImagePullBackOff", deleting=True), FAR) is None, "already being deleted"
    assert verdict(pod(started=None, init=[waiting("preflight", "ErrImagePull")]), FAR) is None, "no start time"


def test_zero_turns_each_deadline_off():
    assert verdict(stuck("ImagePullBackOff"), FAR, opts=options("--deadline=0")) is None
    assert verdict(stuck("ImagePullBackOff"), FAR, opts=SPOT).condition == STUCK
    never = options("--report-after=0", "--pending-deadline=0")
    assert verdict(unschedulable(), FAR, peers_ran_at=T0 - 86400, opts=never) is None


def test_unschedulable_fails_the_job_only_after_the_pending_deadline_with_no_trainer_running():
    """Elastic: with peers running, a pending pod is the job running smaller for want of capacity."""
    p = unschedulable()
    assert verdict(p, FAR, peers_ran_at=FAR).condition == WAITING, "a trainer runs now: reported only"
    assert verdict(p, FAR, peers_ran_at=FAR - PENDING + 1).end is False
    v = verdict(p, FAR, peers_ran_at=FAR - PENDING)
    assert (v.condition, v.reason, v.waited, v.end) == (CANNOT_START, "Unschedulable", FAR - T0, True)
    assert "Insufficient nvidia.com/gpu" in v.message and "add capacity or lower parallelism" in v.message
    assert verdict(p, T0 + PENDING - 1, peers_ran_at=T0 - 86400).end is False, "the pod itself is younger"
    assert verdict(p, T0 + PENDING, peers_ran_at=T0 - 86400).condition == CANNOT_START


def test_spot_waits_for_capacity_for_ever_and_reports_it():
    p = unschedulable()
    assert verdict(p, T0 + 599, peers_ran_at=T0 - 86400, opts=SPOT) is None, "before --report-after"
    for now in (T0 + 600, FAR):
        v = verdict(p, now, peers_ran_at=T0 - 86400, opts=SPOT, marked={"gpu-node-9"})
        assert (v.condition, v.reason, v.end) == (WAITING, "WaitingForCapacity", False)
        assert "Insufficient nvidia.com/gpu" in v.message and "gpu-node-9" in v.message


@pytest.mark.parametrize("message", ['0/3 nodes are available: persistentvolumeclaim "shared" not found.',
                                     "0/3 nodes are available: pod has unbound immediate PersistentVolumeClaims."])
def test_a_missing_or_unbound_claim_is_a_missing_object_not_a_capacity_wait(message):
    """Even where the job waits for capacity (spot), a claim that does not exist or never binds (a StorageClass
    that is not there) ends like a missing Secret: CannotStart after the deadline with no trainer running."""
    p = unschedulable(message)
    assert verdict(p, T0 + DEADLINE - 1, peers_ran_at=T0 - 86400, opts=SPOT) is None
    v = verdict(p, T0 + DEADLINE, peers_ran_at=T0 - 86400, opts=SPOT)
    assert v.condition == CANNOT_START and message[:40] in v.message and "create the missing object" in v.message


def test_a_pending_pod_on_a_node_marked_for_the_job_is_ended_at_once_uncounted():
    v = verdict(stuck("PodInitializing"), T0 + 5, marked={"gpu-node-1"})
    assert (v.condition, v.end) == (NODE_AVOIDED, True) and "gpu-node-1" in v.message and LABEL in v.message
    assert verdict(stuck("PodInitializing"), T0 + 5, marked={"gpu-node-2"}) is None


def test_a_node_local_exit_marks_its_node_once():
    exits = OPTS.node_local_exit
    assert exits == {"preflight": 69}
    failed = exited("preflight", 69)
    assert startrules.node_local_failure(failed, exits)
    done = dict(failed, status=dict(failed["status"], conditions=failed["status"]["conditions"] + [
        {"type": NODE_MARKED, "status": "True"}]))
    assert not startrules.node_local_failure(done, exits), "marked already"
    for other in (exited("preflight", 78), exited("trainer", 69), exited("trainer", 137, reason="OOMKilled")):
        assert not startrules.node_local_failure(other, exits)


def test_marks_the_watchdog_set_expire_and_those_set_by_hand_stay():
    assert startrules.expired(str(int(T0)), T0 + 21600, 21600)
    assert not startrules.expired(str(int(T0)), T0 + 21599, 21600)
    assert not startrules.expired("manual", FAR, 21600) and not startrules.expired(str(int(T0)), FAR, 0)


# apimachinery's IsQualifiedName, which the Job API applies to onPodConditions[].type
# (pkg/apis/batch/validation/validation.go, validatePodFailurePolicyRuleOnPodConditions:
# apivalidation.ValidateQualifiedName), and to label keys: an optional DNS-1123 subdomain prefix, "/", a
# name of at most 63 characters.
_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def qualified_name(value: str) -> bool:
    prefix, _, name = value.rpartition("/")
    ok_prefix = not prefix or (len(prefix) <= 253 and _SUBDOMAIN.fullmatch(prefix) is not None)
    return ok_prefix and len(name) <= 63 and _NAME.fullmatch(name) is not None


def test_condition_types_and_the_mark_are_qualified_names_in_our_domain():
    for name in (STUCK, CANNOT_START, NODE_AVOIDED, WAITING, NODE_MARKED, LABEL):
        assert qualified_name(name) and name.split("/")[0].endswith("elastic-mnist.io"), name
    assert qualified_name("DisruptionTarget")
    assert not qualified_name("Elastic_MNIST.io/x") and not qualified_name("a/-b"), "the check can fail"


