"""The start watchdog's manifests on every rendered variant: the ConfigMap holds the modules (no drift), least
privilege (the namespace; nodes only for the job's mark, guarded by an admission policy), the deadlines it
runs with per variant, the mark the trainers avoid, hardening, its egress, and the Job's rules on its
conditions ahead of the exit-code rules.

    python -m pytest -q tests/test_startwatch_k8s.py

(tests/test_k8s.py validates every document strictly and runs checkov over them, these included.)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from conftest import load_render
from k8s_manifests import argv, container, find, pod_labels, pod_spec, resolve_env, runtime_labels, trainer_job

from elastic_mnist import exit_codes
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
    assert args[:2] == ["python3", "/opt/startwatch/startwatch.py"], args[:2]
    return startwatch.parse(args[2:])


def test_the_configmap_is_the_modules_in_k8s_and_every_variant(variants):
    sources = {Path(m.__file__).name: Path(m.__file__).read_text() for m in (startwatch, startrules)}
    digest = hashlib.sha256("".join(sources[n] for n in sorted(sources)).encode()).hexdigest()
    committed = [d for ds in render.load_dir(REPO / "k8s").values() for d in ds]
    for name, docs in [("k8s/", committed), *variants.items()]:
        assert find(docs, "ConfigMap", "startwatch")["data"] == sources, f"{name}: stale script"
        annotations = watchdog(docs)["spec"]["template"]["metadata"]["annotations"]
        assert annotations[render.STARTWATCH_HASH] == digest, name
    volume = next(v for v in pod_spec(watchdog(committed))["volumes"] if v["name"] == "script")
    mount = next(m for m in container(watchdog(committed), "startwatch")["volumeMounts"] if m["name"] == "script")
    assert volume["configMap"]["name"] == "startwatch" and mount["mountPath"] == "/opt/startwatch"


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
    ]
    cluster = [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    if variant in SINGLE_NODE:
        assert not cluster and not watchdog_options(docs).avoid_label, "one node: nothing to mark"
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
    assert opts.pending_deadline == 0 if variant in SPOT else opts.pending_deadline >= opts.deadline
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
def test_it_runs_from_a_stock_python_image_locked_down(variant, variants):
    """Not the project's image: an unpullable project image must not block the watchdog that ends it."""
    docs = variants[variant]
    c = container(watchdog(docs), "startwatch")
    project = {x["image"] for x in pod_spec(trainer_job(docs))["containers"]}
    assert c["image"].startswith("python:3.") and c["image"] not in project and c["imagePullPolicy"] == "IfNotPresent"
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] and sc["capabilities"] == {
        "drop": ["ALL"]}
    assert pod_spec(watchdog(docs))["securityContext"]["runAsNonRoot"] and "privileged" not in sc
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
    assert not pod_spec(watchdog(docs)).get("hostNetwork")


def test_loaded_images_leave_the_stock_image_to_the_registry():
    """--loaded sets imagePullPolicy Never on the project's containers only (python is pulled normally)."""
    docs = render.render("kind", "elastic-mnist:dev", loaded=True)
    assert container(trainer_job(docs), "trainer")["imagePullPolicy"] == "Never"
    assert container(watchdog(docs), "startwatch")["imagePullPolicy"] == "IfNotPresent"
    assert container(find(docs, "StatefulSet", "etcd"), "etcd")["imagePullPolicy"] == "IfNotPresent"


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


CONDITION_RULES = {"DisruptionTarget": "Ignore", startrules.NODE_AVOIDED: "Ignore", startrules.STUCK: "FailIndex",
                   startrules.CANNOT_START: "FailJob"}


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
