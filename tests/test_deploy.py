"""The container build and the one-box compose trial: the Dockerfile is hadolint-clean and ships the
torch the tests run with, the build context holds what the wheel needs and nothing heavy, the compose
workers launch with the same elastic settings as the manifests, and deploy/render.py's --image works.
(docker build and docker compose need a Docker engine, which the test machines do not have.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import load_render, tool
from torch.distributed.run import get_args_parser

from elastic_mnist.config import parse_args
from elastic_mnist.contract import torchrun as torchrun_settings

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "deploy" / "Dockerfile"
COMPOSE = REPO / "deploy" / "docker-compose.yaml"


render = load_render()


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) per Dockerfile instruction, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in (x.strip() for x in joined.splitlines()) if line]


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list), f"exec form expected, got {rest!r}"
    return value


DOCKER = instructions(DOCKERFILE.read_text())


def base_version(version: str) -> str:
    return version.split("+")[0]


# -------------------------------------------------------------------------------------------- Dockerfile

def test_hadolint_is_clean():
    run = subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                         capture_output=True, text=True)
    assert run.returncode == 0 and not run.stdout.strip(), run.stdout + run.stderr


@pytest.mark.vision  # and the image's torch: the torch-2.13 tier checks neither
def test_base_image_is_pinned_and_carries_the_tested_torch():
    import torchvision

    args = dict(a.split("=", 1) for kind, a in DOCKER if kind == "ARG" and "=" in a)
    froms = [rest.split()[0] for kind, rest in DOCKER if kind == "FROM"]
    assert froms and all(f == "${BASE_IMAGE}" for f in froms), froms
    image = args["BASE_IMAGE"]
    m = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn9-runtime", image)
    assert m, f"{image}: a pinned PyTorch CUDA runtime tag"
    pins = dict(re.findall(r"(torch|torchvision)==([\w.]+)",
                           " ".join(rest for kind, rest in DOCKER if kind == "RUN")))
    # The base's torch, the pin and the torch these tests run on are one version: the image runs
    # what was tested, and pip finds the pinned torch already installed.
    assert m.group(1) == pins["torch"] == base_version(torch.__version__)
    assert pins["torchvision"] == base_version(torchvision.__version__)


@pytest.mark.vision  # compares the image's pin with the running torch: the torch the image ships
def test_a_cpu_build_installs_the_same_torch_from_the_index_it_is_given():
    """kind has no GPU: the documented build (docs/kubernetes.md, README) puts the CPU build of the tested
    torch on a plain Python; the default build keeps the CUDA base's torch. One pinned install either way."""
    args = dict(a.split("=", 1) for kind, a in DOCKER if kind == "ARG" and "=" in a)
    assert args["TORCH_INDEX_URL"] == '""', "empty by default: pip's own index"
    (run,) = [rest for kind, rest in DOCKER if kind == "RUN" and "torch==" in rest]
    assert '--index-url "$TORCH_INDEX_URL"' in run and run.count(f"torch=={base_version(torch.__version__)} ") == 2
    for doc in (REPO / "README.md", REPO / "docs" / "kubernetes.md"):
        text = doc.read_text().replace("\\\n", " ")
        build = next(line for line in text.splitlines() if line.startswith("docker build") and "BASE_IMAGE" in line)
        assert "--build-arg BASE_IMAGE=python:3" in build and "--build-arg TORCH_INDEX_URL=" in build, doc.name


def test_image_runs_the_pod_entry_process_as_a_non_root_user():
    entry = [rest for kind, rest in DOCKER if kind == "ENTRYPOINT"]
    # `elastic-mnist pod` (PID 1, signal forwarding, finished-job exit) runs torchrun.
    assert len(entry) == 1 and exec_form(entry[0]) == ["elastic-mnist", "pod"]
    user = [rest for kind, rest in DOCKER if kind == "USER"][-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) >= 10000 and gid.isdigit(), "numeric, so runAsNonRoot can verify it"
    docs = [d for docs in render.load_dir(REPO / "k8s").values() for d in docs]
    for w in (d for d in docs if d["kind"] in ("StatefulSet", "Deployment", "Job")):
        if any("elastic-mnist" in c["image"] for c in w["spec"]["template"]["spec"]["containers"]):
            sc = w["spec"]["template"]["spec"]["securityContext"]
            assert (sc["runAsUser"], sc["runAsGroup"]) == (int(uid), int(gid)), w["metadata"]["name"]


def test_default_command_is_a_valid_standalone_run():
    cmd = exec_form([rest for kind, rest in DOCKER if kind == "CMD"][-1])
    ns = get_args_parser().parse_args(cmd)
    assert ns.standalone and ns.module and ns.training_script == "elastic_mnist.train"
    parse_args(list(ns.training_script_args))


def _glob_regex(pattern: str) -> str:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return out


def _docker_ignored(patterns: list[str], path: str) -> bool:
    """Docker's rule for a file: the last matching pattern wins, and a pattern matching a parent
    directory covers everything under it. Enough for the forms .dockerignore uses (*, **, !, dir/)."""
    ignored = False
    parts = path.split("/")
    for p in patterns:
        negate = p.startswith("!")
        regex = _glob_regex((p[1:] if negate else p).rstrip("/"))
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def test_build_context_holds_the_sources_and_nothing_heavy():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copied = [src for kind, rest in DOCKER if kind == "COPY" and not rest.startswith("--from")
              for src in rest.split()[:-1]]
    assert copied
    for src in copied:
        files = [p for p in (REPO / src).rglob("*") if p.is_file() and "__pycache__" not in p.parts] \
            if (REPO / src).is_dir() else [REPO / src]
        assert files, src
        for f in files:
            assert not _docker_ignored(patterns, str(f.relative_to(REPO))), f"{f} is needed by the build"
    for heavy in ("data/MNIST/raw/train-images-idx3-ubyte", ".git/objects/pack/x.pack", ".venv/bin/python",
                  "checkpoints/ckpt-000000100.pt", "runs/mnist/events.out", "tests/test_k8s.py",
                  "elastic_mnist/__pycache__/cli.cpython-311.pyc"):
        assert _docker_ignored(patterns, heavy), heavy
    # The wheel needs what pyproject.toml names: its readme.
    assert "README.md" in copied


# -------------------------------------------------------------------------------------- docker compose

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_etcd_is_a_pinned_release_without_the_v2_api(compose):
    etcd = compose["services"]["etcd"]
    m = re.fullmatch(r"(quay\.io/coreos|gcr\.io/etcd-development)/etcd:v3\.5\.(\d+)", etcd["image"])
    assert m and int(m.group(2)) >= 6, etcd["image"]
    assert not [a for a in etcd["command"] if a.startswith("--enable-v2")], "the default backend is etcd-v3"
    assert etcd["healthcheck"]["test"]


def test_compose_workers_launch_like_the_manifests(compose):
    services = compose["services"]
    workers = {n: s for n, s in services.items() if n != "etcd"}
    assert len(workers) == 2
    assert len({s["hostname"] for s in workers.values()}) == 2, "distinct node identities"
    etcd_cmd = services["etcd"]["command"]
    listen = next(a.split("=", 1)[1] for a in etcd_cmd if a.startswith("--listen-client-urls="))
    etcd_port = listen.rsplit(":", 1)[1]
    for name, s in workers.items():
        assert s["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (COMPOSE.parent / s["build"]["context"]).resolve() == REPO
        assert s["depends_on"]["etcd"]["condition"] == "service_healthy"
        ns = get_args_parser().parse_args(s["command"])
        assert ns.rdzv_endpoint == f"etcd:{etcd_port}", "the etcd service, on the port etcd listens on"
        assert ns.rdzv_backend == "etcd-v3"
        expected = get_args_parser().parse_args(
            torchrun_settings.torchrun_args("etcd-v3", ns.rdzv_endpoint, ns.rdzv_id)
            + ["-m", "elastic_mnist.train", *ns.training_script_args])
        assert vars(ns) == vars(expected)
        config = parse_args(list(ns.training_script_args))
        assert config.backend == "gloo"
        # host:container[:mode], after compose's ${VAR:-default} interpolation (the default here)
        mounts = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", v).split(":")[1] for v in s["volumes"]]
        for path in (config.data_dir, config.checkpoint_dir, config.log_dir):
            assert any(path == m or path.startswith(m + "/") for m in mounts), f"{name}: {path} not on a volume"
        assert int(s["stop_grace_period"].rstrip("s")) > 30
        assert s["environment"]["PYTHONUNBUFFERED"] == "1"


# ---------------------------------------------------------------------------------------- render script

def _render(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "deploy" / "render.py"), *args], capture_output=True, text=True)


def _project_containers(out: Path) -> list[dict]:
    docs = [d for docs in render.load_dir(out).values() for d in docs]
    return [c for d in docs if d["kind"] in ("StatefulSet", "Deployment", "Job")
            for c in (d["spec"]["template"]["spec"].get("initContainers", [])
                      + d["spec"]["template"]["spec"]["containers"])
            if "etcd" not in c["image"]]


def test_render_pins_the_image_by_digest_in_every_project_container(tmp_path):
    digest = "sha256:" + "ab" * 32
    out = tmp_path / "k8s"
    run = _render("--overlay", "node-local", "--out", str(out), "--image",
                  f"registry.internal:5000/ml/elastic-mnist:1.2.3@{digest}")
    assert run.returncode == 0, run.stderr
    containers = _project_containers(out)
    assert {"fetch-mnist", "preflight", "trainer", "startwatch"} <= {c["name"] for c in containers}
    assert {c["image"] for c in containers} == {f"registry.internal:5000/ml/elastic-mnist@{digest}"}
    assert {c["imagePullPolicy"] for c in containers} == {"IfNotPresent"}
    # The base's kind tag (elastic-mnist:0.1.0) is left in no image field.
    text = out.joinpath("30-trainer.yaml").read_text()
    assert not re.search(rf"image: {re.escape(render.BASE_IMAGE_NAME)}[:@\s]", text)


def test_render_takes_a_tag_only_for_an_image_loaded_into_the_nodes(tmp_path):
    run = _render("--out", str(tmp_path / "a"), "--image", "registry.internal/elastic-mnist:1.2.3")
    assert run.returncode != 0 and "digest" in run.stderr and "--loaded" in run.stderr
    assert not (tmp_path / "a").exists()
    out = tmp_path / "kind"
    run = _render("--overlay", "kind", "--out", str(out), "--image", "elastic-mnist:dev", "--loaded")
    assert run.returncode == 0, run.stderr
    containers = _project_containers(out)
    assert {(c["image"], c["imagePullPolicy"]) for c in containers} == {("elastic-mnist:dev", "Never")}


def test_render_refuses_an_untagged_image(tmp_path):
    run = _render("--out", str(tmp_path), "--image", "registry.internal/elastic-mnist")
    assert run.returncode != 0 and "digest" in run.stderr
    assert not list(tmp_path.iterdir())


def test_render_check_reports_a_stale_k8s_dir(tmp_path):
    stale = tmp_path / "k8s"
    shutil.copytree(REPO / "k8s", stale)
    trainer = stale / "30-trainer.yaml"
    trainer.write_text(trainer.read_text().replace("parallelism: 2", "parallelism: 3"))
    run = _render("--check", "--out", str(stale))
    assert run.returncode == 1 and "parallelism: 3" in run.stdout and "parallelism: 2" in run.stdout
