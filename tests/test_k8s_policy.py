"""Kubernetes manifests, the properties a real cluster depends on: the Job's outcome under the controller's
own rule order, placement and disruption, least privilege (Secret items), NotReady tolerations, memory
headroom, the TLS variant, and a default that runs on a stock kind cluster.

    python -m pytest -q tests/test_k8s_policy.py

(tests/test_k8s.py checks the rest: schema, checkov, flags, volumes, network policies.)
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from conftest import load_render
from k8s_manifests import all_containers, argv, container, find, mount_for, pod_spec, selects, trainer_job, workloads
from k8s_pods import stuck, terminated_after_delete, unschedulable

from elastic_mnist.ops import preflight, startwatch

REPO = Path(__file__).resolve().parent.parent
render = load_render()
VARIANTS = render.overlays()
SINGLE_NODE = ("kind", "kind-gpu")
SPOT_LABELS = {"cloud.google.com/gke-spot", "eks.amazonaws.com/capacityType", "karpenter.sh/capacity-type",
               "kubernetes.azure.com/scalesetpriority"}


@pytest.fixture(scope="module")
def variants() -> dict[str, list[dict]]:
    return {name: render.render(name) for name in VARIANTS}


def _max_nodes(job: dict) -> int:
    return preflight.parse_launch(argv(job, container(job, "trainer"))[2:]).max_nodes


def job_outcome(spec: dict, failed: int, succeeded: int) -> str | None:
    """The Job controller's decision in one sync, in its order (kubernetes/kubernetes
    pkg/controller/job/job_controller.go, syncJob, Indexed Jobs with backoffLimitPerIndex): the
    failed-indexes checks first, the success policy only if neither fired."""
    if spec.get("maxFailedIndexes") is not None and failed > spec["maxFailedIndexes"]:
        return "Failed: MaxFailedIndexesExceeded"
    if failed > 0 and failed + succeeded >= spec["completions"]:
        return "Failed: FailedIndexes"
    if any(succeeded >= rule["succeededCount"] for rule in spec["successPolicy"]["rules"]):
        return "Complete"
    return None


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


def pod_rule(rules: list[dict], pod: dict) -> tuple[int | None, str]:
    """matchPodFailurePolicy (pkg/controller/job/pod_failure_policy.go) on a Failed pod: the first rule that
    matches decides, (its index, its action); none matching counts against backoffLimitPerIndex."""
    status = pod["status"]
    assert status["phase"] == "Failed", "with a podFailurePolicy only Failed pods are matched (isPodFailed)"
    for i, rule in enumerate(rules):
        if "onExitCodes" in rule:
            req = rule["onExitCodes"]
            for s in status.get("containerStatuses", []) + status.get("initContainerStatuses", []):
                code = s["state"].get("terminated", {}).get("exitCode", 0)
                if code and req.get("containerName") in (None, s["name"]) and \
                        (code in req["values"]) == (req["operator"] == "In"):
                    return i, rule["action"]
        elif any((c["type"], c["status"]) == (p["type"], p["status"])
                 for c in status.get("conditions", []) for p in rule["onPodConditions"]):
            return i, rule["action"]
    return None, "Count"


def _ended_by_watchdog(pod: dict, now: float) -> dict:
    verdict = startwatch.decide(pod, now, 900, 1800, peers_ran_at=0)
    body = startwatch.condition_patch(pod, verdict, now).body
    return terminated_after_delete(pod, body["status"]["conditions"][0])


STUCK = {"preflight image": stuck("ImagePullBackOff"), "unschedulable": unschedulable(),
         "trainer Secret key": stuck("CreateContainerConfigError", "trainer")}


@pytest.mark.parametrize("case", sorted(STUCK))
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_pod_the_watchdog_ended_fails_its_index_by_the_watchdogs_rule(variant, case, variants):
    """The pod as the kubelet (or pod GC) leaves it after the watchdog's patch and delete: its containers
    read exit 137, which alone would be the OOM rule (trainer) or a plain retry (preflight)."""
    rules = trainer_job(variants[variant])["spec"]["podFailurePolicy"]["rules"]
    ended = _ended_by_watchdog(STUCK[case], now=10**10)
    assert pod_rule(rules, ended) == (1, "FailIndex")
    assert rules[1]["onPodConditions"][0]["type"] == startwatch.CONDITION
    plain = pod_rule(rules, terminated_after_delete(STUCK[case], None))  # a `kubectl delete pod` instead
    oom = next(i for i, r in enumerate(rules) if r.get("onExitCodes", {}).get("values") == [137])
    assert plain == ((oom, "FailIndex") if case == "trainer Secret key" else (None, "Count")), plain


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_bad_image_everywhere_fails_the_job_in_bounded_time_and_one_node_costs_one_index(variant, variants):
    """Every pod stuck: each round the watchdog fails `parallelism` indexes (FailIndex) and the spares
    start; the 4th fails the Job with MaxFailedIndexesExceeded after ceil(4 / parallelism) deadlines.
    One node's pull problem costs one index and a finished run still ends Complete."""
    spec = trainer_job(variants[variant])["spec"]
    rules = spec["podFailurePolicy"]["rules"]
    ended = _ended_by_watchdog(STUCK["preflight image"], now=10**10)
    failed = rounds = 0
    while job_outcome(spec, failed, 0) is None:
        rounds += 1
        failed += sum(pod_rule(rules, ended)[1] == "FailIndex" for _ in range(spec["parallelism"]))
    assert job_outcome(spec, failed, 0) == "Failed: MaxFailedIndexesExceeded"
    assert rounds == math.ceil((spec["maxFailedIndexes"] + 1) / spec["parallelism"]) == 2
    assert job_outcome(spec, failed=1, succeeded=spec["parallelism"]) == "Complete"


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_trainer_per_node_of_the_same_job(variant, variants):
    job = trainer_job(variants[variant])
    affinity = pod_spec(job)["affinity"]
    if variant in SINGLE_NODE:
        assert "podAntiAffinity" not in affinity, "on one node a required spread leaves trainers Pending"
        return
    anti = affinity["podAntiAffinity"]
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in anti
    (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert selects(term["labelSelector"], labels)
    # Scoped to this job: its name label, and the Job object's own UID label added at run time.
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == labels["app.kubernetes.io/instance"]
    assert term["matchLabelKeys"] == ["batch.kubernetes.io/controller-uid"]
    other_job = dict(labels, **{"app.kubernetes.io/instance": "other"})
    assert not selects(term["labelSelector"], other_job)


@pytest.mark.parametrize("variant", VARIANTS)
def test_etcd_is_required_off_spot_and_its_members_apart(variant, variants):
    docs = variants[variant]
    etcd = find(docs, "StatefulSet", "etcd")
    spec = pod_spec(etcd)
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {e["key"] for e in term["matchExpressions"]} == SPOT_LABELS
    assert all(e["operator"] in ("NotIn", "DoesNotExist") for e in term["matchExpressions"])
    (anti,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname" and selects(anti["labelSelector"],
                                                                      etcd["spec"]["template"]["metadata"]["labels"])
    spread = spec.get("topologySpreadConstraints", [])
    if variant == "etcd-ha":
        assert etcd["spec"]["replicas"] == 3
        assert [(c["topologyKey"], c["whenUnsatisfiable"]) for c in spread] == [
            ("topology.kubernetes.io/zone", "ScheduleAnyway")]
    else:
        assert etcd["spec"]["replicas"] == 1 and not spread


@pytest.mark.parametrize("variant", VARIANTS)
def test_trainers_and_etcd_ask_autoscalers_not_to_move_them(variant, variants):
    docs = variants[variant]
    for w in (trainer_job(docs), find(docs, "StatefulSet", "etcd")):
        annotations = w["spec"]["template"]["metadata"]["annotations"]
        assert annotations["karpenter.sh/do-not-disrupt"] == "true"
        assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"


@pytest.mark.parametrize("variant", VARIANTS)
def test_trainers_mount_only_the_job_password_and_the_rendezvous_secret(variant, variants):
    job = trainer_job(variants[variant])
    secrets = [v["secret"] for v in pod_spec(job)["volumes"] if "secret" in v]
    by_name = {s["secretName"]: s for s in secrets}
    assert by_name["elastic-mnist-etcd"]["items"] == [{"key": "job-password", "path": "job-password"},
                                                      {"key": "rdzv-secret", "path": "rdzv-secret"}]
    tls = by_name.pop("elastic-mnist-etcd-tls", None)
    assert set(by_name) == {"elastic-mnist-etcd"}
    if variant == "etcd-tls":
        assert tls["items"] == [{"key": "ca.crt", "path": "ca.crt"}], "the CA only, never the server key"
    else:
        assert tls is None
    assert all("items" in s for s in secrets), "a Secret without items mounts every key"


@pytest.mark.parametrize("variant", VARIANTS)
def test_trainers_leave_a_node_that_stopped_answering_within_a_minute(variant, variants):
    tolerations = pod_spec(trainer_job(variants[variant]))["tolerations"]
    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
        (t,) = [t for t in tolerations if t["key"] == key]
        assert t["effect"] == "NoExecute" and t["operator"] == "Exists" and 0 < t["tolerationSeconds"] <= 60


def _gib(quantity: str) -> float:
    m = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    return int(m.group(1)) / (1024 if m.group(2) == "Mi" else 1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_trainer_memory_is_guaranteed_and_holds_dev_shm(variant, variants):
    """request == limit (nothing promised that the node lacks), and the limit holds the memory-backed
    /dev/shm (it counts against the limit) plus at least 2 GiB for the agent and worker processes."""
    job = trainer_job(variants[variant])
    c = container(job, "trainer")
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
    _, shm = mount_for(job, c, "/dev/shm")
    assert _gib(c["resources"]["limits"]["memory"]) >= _gib(shm["emptyDir"]["sizeLimit"]) + 2


def test_tls_variant_serves_https_and_the_trainers_verify_it(variants):
    from k8s_manifests import resolve_env

    from elastic_mnist.etcd import auth as etcd_auth

    docs = variants["etcd-tls"]
    etcd = find(docs, "StatefulSet", "etcd")
    env = resolve_env(etcd, container(etcd, "etcd"), pod_name="etcd-0")
    assert env["ETCD_LISTEN_CLIENT_URLS"].startswith("https://")
    assert env["ETCD_ADVERTISE_CLIENT_URLS"] == "https://etcd-0.etcd:2379"
    for key in ("ETCD_CERT_FILE", "ETCD_KEY_FILE"):
        _, volume = mount_for(etcd, container(etcd, "etcd"), env[key])
        assert volume["secret"]["secretName"] == "elastic-mnist-etcd-tls"
    sidecar = etcd_auth._parse(container(etcd, "etcd-auth")["args"])
    assert sidecar.protocol == "https" and mount_for(etcd, container(etcd, "etcd-auth"), sidecar.cacert)
    job = trainer_job(docs)
    for c in (container(job, "trainer"), container(job, "preflight")):
        launch = preflight.parse_launch(argv(job, c)[2:])
        assert launch.conn["protocol"] == "https"
        m, volume = mount_for(job, c, launch.conn["cacert"])
        assert m["readOnly"] and volume["secret"]["secretName"] == "elastic-mnist-etcd-tls"


def test_the_default_rendering_runs_on_stock_kind(variants):
    """k8s/ (the `kind` overlay): nothing a stock kind node lacks: no GPU request or toleration, no
    one-per-node rule, claims the default `standard` class serves; README's one-line apply says so."""
    assert render.DEFAULT_OVERLAY == "kind"
    docs = [d for ds in render.load_dir(REPO / "k8s").values() for d in ds]
    assert sorted(map(repr, docs)) == sorted(map(repr, variants["kind"]))  # split into files, same documents
    for w in workloads(docs):
        for c in all_containers(w):
            for kind in ("requests", "limits"):
                assert "nvidia.com/gpu" not in c["resources"][kind], f"{w['metadata']['name']}/{c['name']}"
        assert not [t for t in pod_spec(w).get("tolerations", []) if t["key"] == "nvidia.com/gpu"]
        assert "--backend=nccl" not in " ".join(argv(w, all_containers(w)[-1]))
    assert "podAntiAffinity" not in pod_spec(trainer_job(docs))["affinity"]
    readme = (REPO / "README.md").read_text()
    lines = readme.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("kubectl apply -f k8s"))
    assumes = " ".join(x.split("#", 1)[1] for x in lines[at:at + 3] if "#" in x)
    assert "assumes" in assumes and "kind" in assumes and "no GPU" in assumes, assumes


def _kind_section() -> str:
    text = (REPO / "docs" / "kubernetes.md").read_text()
    return text.split("## kind (the default)", 1)[1].split("\n## ", 1)[0]


def test_the_documented_kind_commands_match_the_manifests(variants):
    """docs/kubernetes.md's kind walk-through as far as it can run here: every file it applies exists, the
    node image is a release the manifests validate for, and the Secret it creates has exactly the keys the
    pods mount."""
    section = _kind_section()
    applied = re.findall(r"kubectl apply((?: -f \S+)+)", section)
    for files in applied:
        for path in files.split(" -f ")[1:]:
            assert (REPO / path).exists(), path
    (node,) = re.findall(r"kindest/node:v(\d+)\.(\d+)\.\d+", section)
    assert (int(node[0]), int(node[1])) >= (1, 33)
    created = set(re.findall(r"--from-literal=([a-z-]+)=", section))
    docs = variants["kind"]
    wanted = {i["key"] for w in workloads(docs) for v in pod_spec(w)["volumes"]
              if v.get("secret", {}).get("secretName") == "elastic-mnist-etcd" for i in v["secret"]["items"]}
    assert created == wanted == {"root-password", "job-password", "rdzv-secret"}
    assert "--timeout=" in section.split("kubectl -n elastic-mnist wait", 1)[1].splitlines()[0]
