"""Kubernetes manifests, the properties a real cluster depends on besides the Job's outcome: placement and
disruption, least privilege (Secret items), NotReady tolerations, memory headroom, the TLS variant, and a
default that runs on a stock kind cluster whose documented commands agree with the manifests.

    python -m pytest -q tests/test_k8s_placement.py

(tests/test_k8s_policy.py models the Job's outcome; tests/test_k8s.py checks schema, checkov, flags, volumes,
network policies.)
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import load_render, tool
from k8s_manifests import all_containers, argv, container, find, mount_for, pod_spec, selects, trainer_job, workloads

from elastic_mnist.ops import preflight

REPO = Path(__file__).resolve().parent.parent
render = load_render()
VARIANTS = render.overlays()
SINGLE_NODE = ("kind", "kind-gpu")
CLOUD = ("gke", "eks", "aks")  # etcd-ha is their default
SPOT_LABELS = {"cloud.google.com/gke-spot", "eks.amazonaws.com/capacityType", "karpenter.sh/capacity-type",
               "kubernetes.azure.com/scalesetpriority"}


@pytest.fixture(scope="module")
def variants() -> dict[str, list[dict]]:
    return {name: render.render(name) for name in VARIANTS}


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
    if variant in ("etcd-ha", *CLOUD):  # a system-pool drain or upgrade moves one member of three
        assert etcd["spec"]["replicas"] == 3
        assert [(c["topologyKey"], c["whenUnsatisfiable"]) for c in spread] == [
            ("topology.kubernetes.io/zone", "ScheduleAnyway")]
    else:
        assert etcd["spec"]["replicas"] == 1 and not spread


@pytest.mark.parametrize("variant", VARIANTS)
def test_trainers_and_etcd_keep_the_scale_down_off_and_the_spot_notice(variant, variants):
    """The cluster autoscaler's scale-down leaves their nodes alone; no pod carries karpenter.sh/do-not-disrupt,
    which would keep Karpenter from evicting it at a spot interruption (the trainer would lose its 2-minute notice,
    etcd's member would die with its node instead of moving within its disruption budget)."""
    docs = variants[variant]
    for w in (trainer_job(docs), find(docs, "StatefulSet", "etcd")):
        annotations = w["spec"]["template"]["metadata"]["annotations"]
        assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    for w in workloads(docs):
        assert "karpenter.sh/do-not-disrupt" not in w["spec"]["template"]["metadata"].get("annotations", {})


def _doc_yaml(kind: str) -> dict:
    blocks = re.findall(r"```yaml\n(.*?)```", (REPO / "docs" / "kubernetes.md").read_text(), re.S)
    (found,) = [d for b in blocks for d in yaml.safe_load_all(b) if d and d.get("kind") == kind]
    return found


def test_the_eks_recipes_karpenter_nodepool_keeps_consolidation_off_running_trainers():
    """Consolidation only of empty nodes (a running trainer keeps its node), at most one node disrupted at a time
    (drift, expiry), spot first, and the GPU taint the trainers tolerate; the docs say this is how."""
    pool = _doc_yaml("NodePool")
    assert pool["apiVersion"] == "karpenter.sh/v1"
    assert pool["spec"]["disruption"]["consolidationPolicy"] == "WhenEmpty"
    assert pool["spec"]["disruption"]["budgets"] == [{"nodes": "1"}]
    template = pool["spec"]["template"]["spec"]
    (capacity,) = [r for r in template["requirements"] if r["key"] == "karpenter.sh/capacity-type"]
    assert capacity["values"][0] == "spot"
    job = trainer_job(render.render("eks"))
    tolerated = {t["key"] for t in pod_spec(job)["tolerations"]}
    assert {t["key"] for t in template["taints"]} <= tolerated
    assert int(pool["spec"]["limits"]["nvidia.com/gpu"]) == preflight.parse_launch(
        argv(job, container(job, "trainer"))[2:]).max_nodes
    docs = " ".join((REPO / "docs" / "kubernetes.md").read_text().split())
    assert "`consolidationPolicy: WhenEmpty`" in docs and "do-not-disrupt" in docs


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


def _kind_commands() -> list[str]:
    """The kind section's bash block of docs/kubernetes.md, one command per entry (continuations joined)."""
    text = (REPO / "docs" / "kubernetes.md").read_text()
    section = text.split("## kind (the default)", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [" ".join(c.split()) for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def _command(commands: list[str], start: str) -> str:
    (found,) = [c for c in commands if c.startswith(start)]
    return found.split(" #", 1)[0]


def _bash(command: str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = f"{Path(tool('kubectl')).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=dict(os.environ, PATH=path))


def test_the_documented_kind_commands_run_as_far_as_this_machine_allows(variants, tmp_path):
    """docs/kubernetes.md's kind walk-through: every file it applies exists; the node image is a release the
    manifests validate for; the image is built with build arguments the Dockerfile has (CPU torch on a
    plain Python); the Secret command, run by the real kubectl offline (--dry-run=client), makes a Secret
    that validates and has exactly the keys the pods mount; the wait loop, run against Job objects, ends on
    Complete and on Failed and goes on while the Job runs."""
    commands = _kind_commands()
    for command in (c for c in commands if c.startswith("kubectl apply")):
        for path in re.findall(r"-f (\S+)", command):
            assert (REPO / path).exists(), path
    (node,) = re.findall(r"kindest/node:v(\d+)\.(\d+)\.\d+", _command(commands, "kind create cluster"))
    assert (int(node[0]), int(node[1])) >= (1, 33)
    build = _command(commands, "docker build")
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    args = dict(re.findall(r"--build-arg (\w+)=(\S+)", build))
    assert set(args) == {"BASE_IMAGE", "TORCH_INDEX_URL"} and all(f"ARG {k}=" in dockerfile for k in args)
    assert re.fullmatch(r"python:3\.\d+-slim", args["BASE_IMAGE"]) and args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    secret_run = _bash(_command(commands, "kubectl -n elastic-mnist create secret") + " --dry-run=client -o yaml",
                       tmp_path)
    assert secret_run.returncode == 0, secret_run.stderr
    secret = yaml.safe_load(secret_run.stdout)
    (tmp_path / "secret.yaml").write_text(secret_run.stdout)
    valid = subprocess.run([tool("kubernetes-validate"), "-k", "1.33.0", "--strict", "--quiet",
                            str(tmp_path / "secret.yaml")], capture_output=True, text=True, timeout=120)
    assert valid.returncode == 0, valid.stdout + valid.stderr
    wanted = {i["key"] for w in workloads(variants["kind"]) for v in pod_spec(w)["volumes"]
              if v.get("secret", {}).get("secretName") == "elastic-mnist-etcd" for i in v["secret"]["items"]}
    assert set(secret["data"]) == wanted == {"root-password", "job-password", "rdzv-secret"}
    assert len({base64.b64decode(v) for v in secret["data"].values()}) == 3, "three different random values"
    loop = _command(commands, "until kubectl -n elastic-mnist get job trainer")
    for conditions, ends in (([("SuccessCriteriaMet", "True"), ("Complete", "True")], True),
                             ([("FailureTarget", "True"), ("Failed", "True")], True),
                             ([("SuccessCriteriaMet", "True")], False), ([("Suspended", "False")], False)):
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "trainer", "namespace": "elastic-mnist"},
               "status": {"conditions": [{"type": t, "status": v} for t, v in conditions]}}
        (tmp_path / "job.json").write_text(json.dumps(job))
        probe = loop.split("until ", 1)[1].split("; do", 1)[0].replace(
            "kubectl -n elastic-mnist get job trainer", "kubectl annotate --local -f job.json probe=1")
        assert (_bash(probe, tmp_path).returncode == 0) is ends, conditions


def test_the_recipes_gpu_pools_grow_where_the_docs_count_on_a_new_node():
    """A marked node is replaced only by an autoscaler: GKE's and AKS's GPU pools autoscale up to the most trainers
    that run; the EKS node group cannot, and the docs say so and give Karpenter's NodePool instead."""
    text = (REPO / "docs" / "kubernetes.md").read_text()
    commands = [c.replace("\\\n", " ") for c in re.findall(r"```bash\n(.*?)```", text, re.S)]
    gke = next(line for c in commands for line in c.splitlines() if "node-pools create gpu" in line)
    aks = next(line for c in commands for line in c.splitlines() if "nodepool add" in line and "-n gpu" in line)
    assert "--enable-autoscaling" in gke and "--min-nodes=0" in gke and "--max-nodes=4" in gke
    assert "--enable-cluster-autoscaler" in aks and "--min-count 0" in aks and "--max-count 4" in aks
    flat = " ".join(text.split())
    assert "The `gpu` node group above has a fixed size" in flat and "`EveryNodeMarked`" in flat
    assert "a cluster autoscaler adds a fresh node" not in flat, "only where the recipe has one"
