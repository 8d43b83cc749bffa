"""The start watchdog's manifests on every rendered variant: the ConfigMap is the module (no drift), least
privilege in the namespace, the deadlines it runs with, hardening, the API-server-only network policy, and
the Job's FailIndex rule on its condition ahead of the exit-code rules.

    python -m pytest -q tests/test_startwatch_k8s.py

(tests/test_k8s.py validates every document strictly and runs checkov over them, these included.)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from conftest import load_render
from k8s_manifests import argv, container, find, pod_labels, pod_spec, runtime_labels, trainer_job

from elastic_mnist.ops import startwatch

REPO = Path(__file__).resolve().parent.parent
render = load_render()
VARIANTS = render.overlays()
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


def test_the_configmap_is_the_module_in_k8s_and_every_variant(variants):
    source = Path(startwatch.__file__).read_text()
    committed = [d for ds in render.load_dir(REPO / "k8s").values() for d in ds]
    for name, docs in [("k8s/", committed), *variants.items()]:
        assert find(docs, "ConfigMap", "startwatch")["data"] == {"startwatch.py": source}, f"{name}: stale script"
        annotations = watchdog(docs)["spec"]["template"]["metadata"]["annotations"]
        assert annotations[render.STARTWATCH_HASH] == hashlib.sha256(source.encode()).hexdigest(), name
    volume = next(v for v in pod_spec(watchdog(committed))["volumes"] if v["name"] == "script")
    mount = next(m for m in container(watchdog(committed), "startwatch")["volumeMounts"] if m["name"] == "script")
    assert volume["configMap"]["name"] == "startwatch" and mount["mountPath"] == "/opt/startwatch"


@pytest.mark.parametrize("variant", VARIANTS)
def test_least_privilege_in_the_namespace_only(variant, variants):
    docs = variants[variant]
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role, binding = find(docs, "Role", "startwatch"), find(docs, "RoleBinding", "startwatch")
    namespace = trainer_job(docs)["metadata"]["namespace"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "delete"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
    ]
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
def test_it_watches_this_jobs_trainers_with_generous_deadlines(variant, variants):
    docs = variants[variant]
    opts = watchdog_options(docs)
    assert opts.deadline >= 600 and opts.pending_deadline >= opts.deadline and 0 < opts.interval <= 60
    wanted = dict(kv.split("=", 1) for kv in opts.selector.split(","))
    job = trainer_job(docs)
    assert wanted.items() <= runtime_labels(job).items(), "the selector matches the trainer pods"
    other = dict(runtime_labels(job), **{"app.kubernetes.io/instance": "other"})
    assert not wanted.items() <= other.items(), "and not another job's"
    deployment = watchdog(docs)
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}


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
def test_it_reaches_only_the_api_server(variant, variants):
    policy = find(variants[variant], "NetworkPolicy", "startwatch")
    assert pod_labels(watchdog(variants[variant])).items() >= policy["spec"]["podSelector"]["matchLabels"].items()
    assert sorted(policy["spec"]["policyTypes"]) == ["Egress", "Ingress"] and policy["spec"]["ingress"] == []
    (rule,) = policy["spec"]["egress"]
    assert rule["to"] == [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}], "no DNS"


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_job_fails_the_index_on_the_watchdogs_condition_before_any_exit_code_rule(variant, variants):
    rules = trainer_job(variants[variant])["spec"]["podFailurePolicy"]["rules"]
    ours = [i for i, r in enumerate(rules)
            if {"type": startwatch.CONDITION, "status": "True"} in r.get("onPodConditions", [])]
    assert ours == [1] and rules[1]["action"] == "FailIndex", "right after the disruption rule"
    assert rules[0]["onPodConditions"][0]["type"] == "DisruptionTarget"
    assert all("onExitCodes" in r for r in rules[2:]), "every exit-code rule comes after it"
