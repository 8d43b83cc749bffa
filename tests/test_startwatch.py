"""The start watchdog's decisions on real pod and event objects, and the exact API requests it sends.

    python -m pytest -q tests/test_startwatch.py

(tests/test_startwatch_k8s.py checks its manifests; tests/test_k8s_policy.py what the Job makes of the pod.)
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

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

from elastic_mnist.ops import startrules, startwatch
from elastic_mnist.ops.startrules import (
    CANNOT_START,
    CONFIG_REASONS,
    IMAGE_REASONS,
    NODE_AVOIDED,
    NODE_MARKED,
    STUCK,
    WAITING,
    Verdict,
    decide,
)

DEADLINE, PENDING = 900.0, 1800.0
FAR = T0 + 10 * 86400  # long after every deadline
LABEL = "avoid.elastic-mnist.io/mnist"


def options(*extra: str):
    return startwatch.parse(["--selector=app.kubernetes.io/component=trainer", f"--avoid-label={LABEL}",
                             "--node-local-exit=preflight:69", *extra])


OPTS, SPOT = options(), options("--pending-deadline=0")


def verdict(p: dict, now: float, peers_ran_at: float = T0, opts=OPTS, mounts=(), marked=frozenset()) -> Verdict | None:
    return decide(p, now, opts, peers_ran_at, list(mounts), frozenset(marked))


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


def test_the_requests_are_exact():
    p = stuck("ImagePullBackOff")
    v = verdict(p, T0 + 2 + DEADLINE)
    req = startwatch.condition_patch(p, v, T0 + 2 + DEADLINE)
    assert (req.method, req.path) == ("PATCH", "/api/v1/namespaces/elastic-mnist/pods/trainer-0-x7k2p/status")
    assert req.content_type == "application/strategic-merge-patch+json", "conditions merge by type, others stay"
    assert req.body == {"metadata": {"uid": p["metadata"]["uid"]}, "status": {"conditions": [{
        "type": STUCK, "status": "True", "reason": "ImagePullBackOff", "message": v.message,
        "lastTransitionTime": "2026-12-01T12:15:02Z"}]}}
    delete = startwatch.delete_request(p)
    assert (delete.method, delete.path) == ("DELETE", "/api/v1/namespaces/elastic-mnist/pods/trainer-0-x7k2p")
    assert delete.body == {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": p["metadata"]["uid"]}}
    selector = "app.kubernetes.io/component=trainer,app.kubernetes.io/instance=mnist"
    ls = startwatch.list_request("elastic-mnist", selector)
    assert ls.path == ("/api/v1/namespaces/elastic-mnist/pods?labelSelector=app.kubernetes.io%2Fcomponent%3Dtrainer"
                       "%2Capp.kubernetes.io%2Finstance%3Dmnist")
    ev = startwatch.events_request("elastic-mnist")
    assert ev.path == ("/api/v1/namespaces/elastic-mnist/events?fieldSelector=involvedObject.kind%3DPod%2C"
                       "reason%3DFailedMount")
    assert startwatch.nodes_request(LABEL).path == "/api/v1/nodes?labelSelector=avoid.elastic-mnist.io%2Fmnist"
    mark, unmark = startwatch.label_request("n1", LABEL, "1796140800"), startwatch.label_request("n1", LABEL, None)
    assert (mark.method, mark.path, mark.content_type) == ("PATCH", "/api/v1/nodes/n1", "application/merge-patch+json")
    assert mark.body == {"metadata": {"labels": {LABEL: "1796140800"}}}
    assert json.dumps(unmark.body) == '{"metadata": {"labels": {"avoid.elastic-mnist.io/mnist": null}}}'


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


class Recorder:
    """The API as answers to what sweep() sends, in order (the requests are the pure builders')."""

    def __init__(self, pods: list[dict], nodes: list[dict] = (), events: list[dict] = ()):
        self.pods, self.nodes, self.events, self.sent = pods, list(nodes), list(events), []

    def send(self, req):
        self.sent.append(req)
        answers = {"/pods?": self.pods, "/nodes?": self.nodes, "/events?": self.events}
        return {"items": next((v for k, v in answers.items() if k in req.path), [])} if req.method == "GET" else {}


def _changes(api: Recorder) -> list[tuple[str, str]]:
    return [(r.method, "/".join(r.path.rsplit("/", 2)[-2:])) for r in api.sent if r.method != "GET"]


def test_a_sweep_ends_marks_reports_and_unmarks_each_once(capsys):
    stuck_pod = stuck("ImagePullBackOff")
    peer = pod(name="trainer-1-q9z4m", uid="u-1", phase="Running", init=[terminated("preflight", 0, T0 + 20)],
               containers=[running("trainer", T0 + 21)], node="gpu-node-2")
    waiting_pod = unschedulable(name="trainer-2-a1b2c", uid="u-2")
    bad = exited("preflight", 69, name="trainer-3-zz", uid="u-3", node="gpu-node-3")
    old_mark = {"metadata": {"name": "gpu-node-7", "labels": {LABEL: str(int(T0))}}}
    api = Recorder([stuck_pod, peer, waiting_pod, bad], nodes=[old_mark])
    opts = options()
    opts.namespace = "elastic-mnist"
    assert startwatch.sweep(api, opts, T0, FAR) == FAR, "a running peer was seen"
    assert _changes(api) == [("PATCH", "trainer-0-x7k2p/status"), ("DELETE", "pods/trainer-0-x7k2p"),
                             ("PATCH", "trainer-2-a1b2c/status"), ("PATCH", "nodes/gpu-node-3"),
                             ("PATCH", "trainer-3-zz/status"), ("PATCH", "nodes/gpu-node-7")]
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["event"] for r in records] == ["ended", "reported", "node-marked", "node-unmarked"]
    assert records[0]["reason"] == "ImagePullBackOff" and records[0]["waited_s"] == round(FAR - T0 - 2)
    assert records[2]["clear"] == f"kubectl label node gpu-node-3 {LABEL}-"
    # The pod API now shows what was patched: a second sweep repeats nothing.
    waiting_pod["status"]["conditions"].append({"type": WAITING, "status": "True", "reason": "WaitingForCapacity"})
    bad["status"]["conditions"].append({"type": NODE_MARKED, "status": "True"})
    fresh_mark = {"metadata": {"name": "gpu-node-3", "labels": {LABEL: str(int(FAR))}}}
    api2 = Recorder([peer, waiting_pod, bad], nodes=[fresh_mark])
    startwatch.sweep(api2, opts, T0, FAR + 30)
    assert _changes(api2) == []
    opts.dry_run = True
    api3 = Recorder([stuck("ImagePullBackOff")])
    startwatch.sweep(api3, opts, T0, FAR)
    assert _changes(api3) == [] and "dry run" in capsys.readouterr().out


def test_bad_arguments_are_refused_with_one_line(capsys):
    assert startwatch.parse(["--selector=x"]).deadline == 900 > 0
    for bad in (["--deadline=-1"], ["--interval=0"], ["--avoid-for=-5"]):
        with pytest.raises(SystemExit):
            startwatch.parse(["--selector=x", *bad])
        assert "must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        startwatch.parse(["--selector=x", "--node-local-exit=preflight"])
    assert "CONTAINER:CODE" in capsys.readouterr().err


def test_the_scripts_need_nothing_but_the_standard_library(tmp_path):
    """They run from a stock Python image: no third-party or project import, and they start isolated, side
    by side in a directory as in the ConfigMap."""
    for module in (startwatch, startrules):
        tree = ast.parse(Path(module.__file__).read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        assert names - {"elastic_mnist", "startrules"} <= set(sys.stdlib_module_names) | {"__future__"}, names
    for module in (startwatch, startrules):
        (tmp_path / Path(module.__file__).name).write_text(Path(module.__file__).read_text())
    run = subprocess.run([sys.executable, "-I", str(tmp_path / "startwatch.py"), "--help"], capture_output=True,
                         text=True, timeout=30, cwd=tmp_path)
    assert run.returncode == 0 and "--avoid-label" in run.stdout, run.stderr
    assert CONFIG_REASONS > IMAGE_REASONS
