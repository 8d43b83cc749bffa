"""The start watchdog's manifests on every rendered variant: it runs `elastic-mnist startwatch` from the project's
image, least privilege (the namespace and its Job's heartbeat; nodes only for the job's mark and the node reads,
guarded by an admission policy), the deadlines it runs with per variant, the mark the trainers avoid, hardening and
its liveness probe, its egress, and the Job's rules on its conditions ahead of the exit-code rules.

    python -m pytest -q tests/test_startwatch_k8s.py

(tests/test_k8s.py validates every document strictly and runs checkov over them, these included.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_render
from k8s_manifests import argv, container, find, pod_labels, pod_spec, resolve_env, runtime_labels, trainer_job

from elastic_mnist.contract import exit_codes
from elastic_mnist.ops import startrules, startwatch

REPO = Path(__file__).resolve().parent.parent
render = load_render()
VARIANTS = render.overlays()
SINGLE_NODE = ("kind", "kind-gpu")
SPOT = ("gke", "eks", "aks")
SA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


@pytest.fixture(scope="module")
def variants() -> dict[str, list[dict]]:
    return {name: render.render(name) for name in VARIANTS}


def watchdog(docs: list[dict]) -> dict:
    return find(docs, "Deployment", "startwatch")


def watchdog_options(docs: list[dict]):
    deployment = watchdog(docs)
    args = argv(deployment, container(deployment, "startwatch"))
    assert args[:2] == ["elastic-mnist", "startwatch"], args[:2]
    return startwatch.parse(args[2:])


@pytest.mark.parametrize("variant", VARIANTS)
def test_it_runs_the_packaged_watchdog_from_the_projects_image(variant, variants):
    """No ConfigMap copy of the script and no third image: the trainers' image, whatever --image pins."""
    docs = variants[variant]
    c, trainer = container(watchdog(docs), "startwatch"), container(trainer_job(docs), "trainer")
    assert (c["image"], c["imagePullPolicy"]) == (trainer["image"], trainer["imagePullPolicy"])
    assert not [d for d in docs if d["kind"] == "ConfigMap"]
    assert watchdog_options(docs).job == trainer_job(docs)["metadata"]["name"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_least_privilege(variant, variants):
    docs = variants[variant]
    role, binding = find(docs, "Role", "startwatch"), find(docs, "RoleBinding", "startwatch")
    namespace = trainer_job(docs)["metadata"]["namespace"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "delete"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},
        {"apiGroups": ["batch"], "resources": ["jobs"], "resourceNames": [trainer_job(docs)["metadata"]["name"]],
         "verbs": ["patch"]},  # the heartbeat annotation, on this Job only
    ]
    cluster = [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    if variant in SINGLE_NODE:
        opts = watchdog_options(docs)
        assert not cluster and not opts.avoid_label and not opts.node_lost_after, "one node: no node is read"
    else:
        (crole,) = [d for d in cluster if d["kind"] == "ClusterRole"]
        (cbinding,) = [d for d in cluster if d["kind"] == "ClusterRoleBinding"]
        assert crole["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "patch"]}]
        assert cbinding["roleRef"]["name"] == crole["metadata"]["name"]
        assert cbinding["subjects"] == [{"kind": "ServiceAccount", "name": "startwatch", "namespace": namespace}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "startwatch"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "startwatch", "namespace": namespace}]
    account = find(docs, "ServiceAccount", "startwatch")
    assert account["automountServiceAccountToken"] is False
    spec = pod_spec(watchdog(docs))
    assert spec["serviceAccountName"] == "startwatch" and spec["automountServiceAccountToken"] is False
    # The token reaches this one container through an explicit projected volume, read-only.
    (mount,) = [m for m in container(watchdog(docs), "startwatch")["volumeMounts"] if m["mountPath"] == SA_PATH]
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    sources = volume["projected"]["sources"]
    assert mount["readOnly"] and sources[0]["serviceAccountToken"]["path"] == "token"
    assert sources[1]["configMap"] == {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert sources[2]["downwardAPI"]["items"] == [{"path": "namespace",
                                                   "fieldRef": {"fieldPath": "metadata.namespace"}}]


@pytest.mark.parametrize("variant", VARIANTS)
def test_it_watches_this_jobs_trainers_with_deadlines_deliberate_per_variant(variant, variants):
    """Spot variants wait for capacity (never end an unschedulable trainer, report it); elsewhere a cluster
    that placed no trainer for the pending deadline ends the Job. Every variant reports first."""
    docs = variants[variant]
    opts = watchdog_options(docs)
    assert opts.deadline >= 600 and 0 < opts.interval <= 60 and 0 < opts.report_after < opts.deadline
    assert opts.pending_deadline >= 4 * 3600 if variant in SPOT else opts.pending_deadline >= opts.deadline
    assert opts.pending_deadline <= 6 * 3600, "finite everywhere: a drought longer than that is the operator's"
    assert 0 < opts.marked_deadline <= opts.pending_deadline, "every node marked: sooner than any other wait"
    assert opts.marked_deadline < opts.avoid_for, "and much sooner than the marks expire"
    if variant not in SINGLE_NODE:
        assert 0 < opts.node_lost_after <= 600
    wanted = dict(kv.split("=", 1) for kv in opts.selector.split(","))
    job = trainer_job(docs)
    assert wanted.items() <= runtime_labels(job).items(), "the selector matches the trainer pods"
    other = dict(runtime_labels(job), **{"app.kubernetes.io/instance": "other"})
    assert not wanted.items() <= other.items(), "and not another job's"
    deployment = watchdog(docs)
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}


def _required_terms(job: dict) -> list[dict]:
    node = pod_spec(job)["affinity"].get("nodeAffinity", {})
    return node.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_mark_is_the_one_the_trainers_avoid_and_only_node_local_exits_set_it(variant, variants):
    """The label the watchdog sets is the key the trainers' required node affinity says DoesNotExist, per job
    (its instance label); what sets it is exactly the Job's FailIndex exits for this node (preflight's, and a
    trainer that gave up); both containers hold that exit for two sweeps (the node is marked before a
    replacement could fail there)."""
    docs = variants[variant]
    opts, job = watchdog_options(docs), trainer_job(docs)
    if variant in SINGLE_NODE:
        assert not opts.avoid_label and not _required_terms(job), "one node: a mark would only leave trainers Pending"
        assert "ELASTIC_MNIST_NODE_LOCAL_HOLD_S" not in resolve_env(job, container(job, "preflight"))
        return
    instance = runtime_labels(job)["app.kubernetes.io/instance"]
    assert opts.avoid_label == f"avoid.elastic-mnist.io/{instance}"
    (term,) = _required_terms(job)
    assert term["matchExpressions"] == [{"key": opts.avoid_label, "operator": "DoesNotExist"}]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    fail_index = {(r["onExitCodes"]["containerName"], v) for r in rules if r["action"] == "FailIndex"
                  and "onExitCodes" in r for v in r["onExitCodes"]["values"]}
    assert opts.node_local_exit == {"preflight": exit_codes.NODE_LOCAL, "trainer": exit_codes.NODE_LOCAL}
    assert set(opts.node_local_exit.items()) <= fail_index
    for name in opts.node_local_exit:
        assert float(resolve_env(job, container(job, name))["ELASTIC_MNIST_NODE_LOCAL_HOLD_S"]) >= 2 * opts.interval
    assert 3600 <= opts.avoid_for <= 86400, "long enough to matter, short enough not to starve a small pool"


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v not in SINGLE_NODE])
def test_node_updates_by_the_watchdog_are_limited_to_the_mark(variant, variants):
    """RBAC cannot narrow `patch` to one label: an admission policy matching the watchdog's account allows a
    node update only if spec, annotations and every label outside the mark's prefix are unchanged."""
    docs = variants[variant]
    policy = find(docs, "ValidatingAdmissionPolicy", "elastic-mnist-startwatch-nodes")
    binding = find(docs, "ValidatingAdmissionPolicyBinding", "elastic-mnist-startwatch-nodes")
    namespace = trainer_job(docs)["metadata"]["namespace"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["nodes"]}]
    (who,) = policy["spec"]["matchConditions"]
    assert who["expression"] == f'request.userInfo.username == "system:serviceaccount:{namespace}:startwatch"'
    (rule,) = policy["spec"]["validations"]
    prefix = watchdog_options(docs).avoid_label.split("/")[0] + "/"
    expression = " ".join(rule["expression"].split())
    assert "object.spec == oldObject.spec" in expression and "annotations" in expression
    assert expression.count(f'k.startsWith("{prefix}")') == 2, "labels added, changed or removed outside the mark"
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


@pytest.mark.parametrize("variant", VARIANTS)
def test_it_runs_locked_down(variant, variants):
    docs = variants[variant]
    c = container(watchdog(docs), "startwatch")
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] and sc["capabilities"] == {
        "drop": ["ALL"]}
    assert pod_spec(watchdog(docs))["securityContext"]["runAsNonRoot"] and "privileged" not in sc
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
    assert not pod_spec(watchdog(docs)).get("hostNetwork")


def test_loaded_images_are_never_pulled_by_the_watchdog_either():
    """--loaded sets imagePullPolicy Never on the project's containers, the watchdog's included; etcd is pulled."""
    docs = render.render("kind", "elastic-mnist:dev", loaded=True)
    assert container(trainer_job(docs), "trainer")["imagePullPolicy"] == "Never"
    assert (container(watchdog(docs), "startwatch")["image"], container(watchdog(docs), "startwatch")[
        "imagePullPolicy"]) == ("elastic-mnist:dev", "Never")
    assert container(find(docs, "StatefulSet", "etcd"), "etcd")["imagePullPolicy"] == "IfNotPresent"


@pytest.mark.parametrize("variant", ["kind", "gke"])
def test_the_liveness_probe_restarts_a_loop_that_stopped_turning(variant, variants, tmp_path):
    """The probe's command, run here against the alive file the watchdog touches every pass: fresh, it passes; as
    old as its bound, or missing, it fails. The bound leaves ten passes, or one whose every call timed out."""
    docs = variants[variant]
    c, opts = container(watchdog(docs), "startwatch"), watchdog_options(docs)
    probe = c["livenessProbe"]
    command = probe["exec"]["command"]
    assert command[:4] == ["python3", "-I", "-S", "-c"] and opts.alive_file in command[4]
    (mount,) = [m for m in c["volumeMounts"] if opts.alive_file.startswith(m["mountPath"] + "/")]
    assert next(v for v in pod_spec(watchdog(docs))["volumes"] if v["name"] == mount["name"])["emptyDir"]
    bound = float(command[4].rsplit(">", 1)[1].strip(" )"))
    assert bound >= 10 * opts.interval and bound <= probe["periodSeconds"] * probe["failureThreshold"] + 300
    alive = tmp_path / "alive"
    code = command[4].replace(opts.alive_file, str(alive))

    def probe_exit() -> int:
        return subprocess.run([sys.executable, *command[1:4], code], capture_output=True, timeout=30).returncode

    assert probe_exit() != 0, "no pass yet"
    alive.touch()
    assert probe_exit() == 0
    old = alive.stat().st_mtime - bound - 1
    os.utime(alive, (old, old))
    assert probe_exit() == 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_its_egress_is_the_api_servers_ports_and_the_docs_say_so(variant, variants):
    """TCP 443/6443 to any address but the link-local range (a NetworkPolicy cannot name the API server):
    exactly what the manifest's comment and docs/kubernetes.md say, not "only the API server"."""
    policy = find(variants[variant], "NetworkPolicy", "startwatch")
    assert pod_labels(watchdog(variants[variant])).items() >= policy["spec"]["podSelector"]["matchLabels"].items()
    assert sorted(policy["spec"]["policyTypes"]) == ["Egress", "Ingress"] and policy["spec"]["ingress"] == []
    (rule,) = policy["spec"]["egress"]
    assert rule["to"] == [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}], "no DNS"
    docs = " ".join((REPO / "docs" / "kubernetes.md").read_text().split())
    assert "TCP 443 and 6443 to any address except link-local" in docs and "only the API server" not in docs


CONDITION_RULES = {"DisruptionTarget": "Ignore", startrules.NODE_AVOIDED: "Ignore", startrules.NODE_LOST: "Ignore",
                   startrules.STUCK: "FailIndex", startrules.CANNOT_START: "FailJob"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_jobs_rules_on_the_watchdogs_conditions_come_before_any_exit_code_rule(variant, variants):
    """Before the exit-code rules: a pod the watchdog deleted reads exit 137 (ContainerStatusUnknown) for
    containers that never ran, which would otherwise be the OOM rule. The report and bookkeeping
    conditions have no rule: they end nothing."""
    rules = trainer_job(variants[variant])["spec"]["podFailurePolicy"]["rules"]
    head = [(r["onPodConditions"][0]["type"], r["action"]) for r in rules if "onPodConditions" in r]
    assert head == list(CONDITION_RULES.items())
    assert all("onPodConditions" in r for r in rules[:len(head)]) and all("onExitCodes" in r for r in rules[len(head):])
    assert all(r["onPodConditions"] == [{"type": r["onPodConditions"][0]["type"], "status": "True"}]
               for r in rules[:len(head)])
    assert startrules.WAITING not in dict(head) and startrules.NODE_MARKED not in dict(head)
