"""The start watchdog's decision on real pod objects and the exact API requests it builds.

    python -m pytest -q tests/test_startwatch.py

(tests/test_startwatch_k8s.py checks its manifests; tests/test_k8s_policy.py what the Job makes of the pod.)
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest
from k8s_pods import T0, pod, running, stuck, terminated, unschedulable, waiting

from elastic_mnist.ops import startwatch
from elastic_mnist.ops.startwatch import CONDITION, CONFIG_REASONS, Verdict, decide

DEADLINE, PENDING = 900.0, 1800.0
FAR = T0 + 10 * 86400  # long after every deadline


def verdict(p: dict, now: float, peers_ran_at: float = T0) -> Verdict | None:
    return decide(p, now, DEADLINE, PENDING, peers_ran_at)


@pytest.mark.parametrize("reason", sorted(CONFIG_REASONS))
@pytest.mark.parametrize("where", ["preflight", "trainer"])
def test_a_configuration_error_is_acted_on_exactly_at_the_deadline(reason, where):
    """Counted from the pod's start (preflight) or from the end of the init container before it (trainer):
    one second short of the deadline nothing happens, at the deadline the pod is ended."""
    p = stuck(reason, where, message='Back-off pulling image "elastic-mnist:0.1.0"')
    since = T0 + 2 if where == "preflight" else T0 + 60
    assert verdict(p, since + DEADLINE - 1) is None
    v = verdict(p, since + DEADLINE)
    assert v.reason == reason and v.waited == DEADLINE
    assert f"container {where} waited 900s in {reason}" in v.message
    config = reason == "CreateContainerConfigError"
    fix = "is missing: create it" if config else "cannot be pulled on this node"
    assert fix in v.message and ("re-apply the Job" in v.message) is not config
    assert f'{reason} (Back-off pulling image "elastic-mnist:0.1.0"): ' in v.message, "the kubelet's own words"
    bare = verdict(stuck(reason, where), since + DEADLINE)
    assert f"in {reason}: " in bare.message, "no empty parentheses without a kubelet message"


def test_a_trainer_after_a_long_preflight_is_not_timed_from_the_pod_start():
    """preflight waits up to 5 minutes for etcd: the trainer container's wait starts when preflight ends."""
    p = pod(init=[terminated("preflight", 0, T0 + 300)], containers=[waiting("trainer", "ErrImagePull")])
    assert verdict(p, T0 + 2 + DEADLINE) is None
    assert verdict(p, T0 + 300 + DEADLINE).reason == "ErrImagePull"


@pytest.mark.parametrize("reason", ["ContainerCreating", "PodInitializing", "CrashLoopBackOff", "CreateContainerError"])
def test_slow_or_other_waits_are_never_ended(reason):
    """A slow pull of a big image is ContainerCreating; those and runtime errors are not this watchdog's."""
    assert verdict(stuck(reason), FAR, peers_ran_at=T0) is None


def test_just_started_running_terminal_and_deleting_pods_are_left_alone():
    assert verdict(stuck("ImagePullBackOff"), T0 + 30) is None, "just started"
    live = pod(phase="Running", init=[terminated("preflight", 0, T0 + 20)], containers=[running("trainer", T0 + 21)])
    assert verdict(live, FAR) is None
    for phase in ("Succeeded", "Failed"):
        assert verdict(pod(phase=phase, init=[waiting("preflight", "ErrImagePull")]), FAR) is None, phase
    assert verdict(stuck("ImagePullBackOff", deleting=True), FAR) is None, "already being deleted"
    assert verdict(pod(started=None, init=[waiting("preflight", "ErrImagePull")]), FAR) is None, "no start time"


def test_zero_turns_each_deadline_off():
    assert decide(stuck("ImagePullBackOff"), FAR, 0, PENDING, T0) is None
    assert decide(unschedulable(), FAR, DEADLINE, 0, T0) is None
    assert decide(stuck("ImagePullBackOff"), FAR, DEADLINE, 0, T0) is not None


def test_unschedulable_is_ended_only_when_no_trainer_ran_for_the_whole_pending_deadline():
    """Elastic: with peers running, a pending pod is the job running smaller for want of capacity."""
    p = unschedulable()
    assert verdict(p, FAR, peers_ran_at=FAR) is None, "a trainer runs now"
    assert verdict(p, FAR, peers_ran_at=FAR - PENDING + 1) is None, "one ran within the pending deadline"
    v = verdict(p, FAR, peers_ran_at=FAR - PENDING)
    assert v.reason == "Unschedulable" and v.waited == FAR - T0
    assert "Insufficient nvidia.com/gpu" in v.message and "add capacity or lower parallelism" in v.message
    # No peer ever ran, but the pod itself is younger than the pending deadline: not yet.
    assert verdict(p, T0 + PENDING - 1, peers_ran_at=T0 - 86400) is None
    assert verdict(p, T0 + PENDING, peers_ran_at=T0 - 86400).reason == "Unschedulable"


def test_scheduled_pending_pods_are_not_unschedulable():
    """A pod on a node without a waiting reason of ours (volume attach, a slow pull) is not ended."""
    assert verdict(pod(init=[waiting("preflight", "PodInitializing")]), FAR, peers_ran_at=T0 - 86400) is None


def test_the_condition_patch_is_a_strategic_merge_of_one_condition_with_the_uid():
    p = stuck("ImagePullBackOff")
    v = verdict(p, T0 + 2 + DEADLINE)
    req = startwatch.condition_patch(p, v, T0 + 2 + DEADLINE)
    assert (req.method, req.path) == ("PATCH", "/api/v1/namespaces/elastic-mnist/pods/trainer-0-x7k2p/status")
    assert req.content_type == "application/strategic-merge-patch+json", "conditions merge by type, others stay"
    assert req.body == {"metadata": {"uid": p["metadata"]["uid"]}, "status": {"conditions": [{
        "type": CONDITION, "status": "True", "reason": "ImagePullBackOff", "message": v.message,
        "lastTransitionTime": "2026-12-01T12:15:02Z"}]}}


def test_the_delete_carries_a_uid_precondition_and_the_list_a_selector():
    p = stuck("ErrImagePull")
    req = startwatch.delete_request(p)
    assert (req.method, req.path) == ("DELETE", "/api/v1/namespaces/elastic-mnist/pods/trainer-0-x7k2p")
    assert req.body == {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": p["metadata"]["uid"]}}
    selector = "app.kubernetes.io/component=trainer,app.kubernetes.io/instance=mnist"
    ls = startwatch.list_request("elastic-mnist", selector)
    assert (ls.method, ls.body) == ("GET", None)
    assert ls.path == ("/api/v1/namespaces/elastic-mnist/pods?labelSelector=app.kubernetes.io%2Fcomponent%3Dtrainer"
                       "%2Capp.kubernetes.io%2Finstance%3Dmnist")


# apimachinery's IsQualifiedName, which the Job API applies to onPodConditions[].type
# (pkg/apis/batch/validation/validation.go, validatePodFailurePolicyRuleOnPodConditions:
# apivalidation.ValidateQualifiedName): an optional DNS-1123 subdomain prefix, "/", a name of at most 63
# characters. Pod conditions of that form are common (readiness gates such as
# cloud.google.com/load-balancer-neg-ready, written through pods/status by a controller).
_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def qualified_name(value: str) -> bool:
    prefix, _, name = value.rpartition("/")
    ok_prefix = not prefix or (len(prefix) <= 253 and _SUBDOMAIN.fullmatch(prefix) is not None)
    return ok_prefix and len(name) <= 63 and _NAME.fullmatch(name) is not None


def test_the_condition_type_is_a_valid_qualified_name_in_our_domain():
    assert qualified_name(CONDITION) and CONDITION.startswith("elastic-mnist.io/")
    assert qualified_name("DisruptionTarget")
    assert not qualified_name("Elastic_MNIST.io/x") and not qualified_name("a/-b"), "the check can fail"


class Recorder:
    """The API as a list of answers: what sweep() sends, in order (the requests are the pure builders')."""

    def __init__(self, pods: list[dict]):
        self.pods, self.sent = pods, []

    def send(self, req):
        self.sent.append(req)
        return {"items": self.pods} if req.method == "GET" else {}


def test_a_sweep_marks_then_deletes_only_the_stuck_pod_and_logs_one_line(capsys):
    stuck_pod = stuck("ImagePullBackOff")
    peer = pod(name="trainer-1-q9z4m", uid="u-1", phase="Running", init=[terminated("preflight", 0, T0 + 20)],
               containers=[running("trainer", T0 + 21)])
    api, now = Recorder([stuck_pod, peer, unschedulable(name="trainer-2-a1b2c", uid="u-2")]), FAR
    opts = startwatch.parse(["--selector=app.kubernetes.io/component=trainer"])
    opts.namespace = "elastic-mnist"
    assert startwatch.sweep(api, opts, T0, now) == now, "a running peer was seen"
    assert [(r.method, r.path.rsplit("/pods/", 1)[-1]) for r in api.sent[1:]] == [
        ("PATCH", "trainer-0-x7k2p/status"), ("DELETE", "trainer-0-x7k2p")]
    (line,) = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record["pod"] == "trainer-0-x7k2p" and record["reason"] == "ImagePullBackOff"
    assert record["waited_s"] == round(now - T0 - 2) and record["action"].startswith("marked " + CONDITION)
    opts.dry_run = True
    api.sent.clear()
    startwatch.sweep(api, opts, T0, now)
    assert [r.method for r in api.sent] == ["GET"] and "dry run" in capsys.readouterr().out


def test_bad_arguments_are_refused_with_one_line(capsys):
    assert startwatch.parse(["--selector=x"]).deadline == 900 > 0
    for bad in (["--deadline=-1"], ["--interval=0"]):
        with pytest.raises(SystemExit):
            startwatch.parse(["--selector=x", *bad])
        assert "must be >= 0" in capsys.readouterr().err


def test_the_script_needs_nothing_but_the_standard_library():
    """It runs from a stock Python image: no third-party or project import, and it starts isolated."""
    tree = ast.parse(open(startwatch.__file__).read())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names - set(sys.stdlib_module_names)
    run = subprocess.run([sys.executable, "-I", startwatch.__file__, "--help"], capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 0 and "--deadline" in run.stdout, run.stderr
