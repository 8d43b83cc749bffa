"""Every image the manifests run is in the docs' list, none is pulled on every start, and the documented mirror
overlay leaves no image on a public registry: what an air-gapped cluster needs.

    python -m pytest -q tests/test_k8s_images.py
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import load_render
from k8s_manifests import all_containers

REPO = Path(__file__).resolve().parent.parent
DOCS = (REPO / "docs" / "kubernetes.md").read_text()
SEED = REPO / "deploy" / "mnist-seed-pod.yaml"
render = load_render()


def _containers(docs: list[dict]) -> list[dict]:
    found = []
    for d in docs:
        if d["kind"] in ("StatefulSet", "Deployment", "Job"):
            found += all_containers(d)
        elif d["kind"] == "Pod":
            found += d["spec"].get("initContainers", []) + d["spec"]["containers"]
    return found


def _section(title: str) -> str:
    start = DOCS.index(f"## {title}")
    return DOCS[start:DOCS.index("\n## ", start + 1)]


@pytest.fixture(scope="module")
def everything() -> list[dict]:
    seed = [d for d in yaml.safe_load_all(SEED.read_text()) if d]
    return [c for name in render.overlays() for c in _containers(render.render(name))] + _containers(seed)


def test_every_image_is_in_the_docs_list_and_none_is_pulled_on_every_start(everything):
    public = {c["image"] for c in everything if not c["image"].startswith(render.BASE_IMAGE_NAME + ":")}
    assert public == {"quay.io/coreos/etcd:v3.5.17", "busybox:1.36.1"}
    assert {c["imagePullPolicy"] for c in everything} == {"IfNotPresent"}
    table = _section("Images and air-gapped clusters")
    assert "Three images run in the cluster" in table
    for image in public | {"elastic-mnist:0.1.0"}:
        assert f"| `{image}`" in table or f"(`{image}` on kind" in table, image
    share_owner = re.search(r"kubectl -n elastic-mnist run share-owner .*?--image=(\S+)", DOCS).group(1)
    assert share_owner in public, "the GKE helper pod uses the listed busybox"


def test_the_documented_mirror_overlay_leaves_no_image_on_a_public_registry(tmp_path, everything):
    mirror = "registry.internal:5000"
    block = _section("Images and air-gapped clusters")
    overlay = re.search(r"<<EOF\n(.*?)\nEOF", block, re.S).group(1).replace("$MIRROR", mirror)
    kustomization = yaml.safe_load(overlay)
    (base,) = kustomization["resources"]
    kustomization["resources"] = [os.path.relpath(REPO / "deploy" / "kustomize" / "overlays" / Path(base).name,
                                                  tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    run = subprocess.run([render.kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    images = {c["image"] for c in _containers([d for d in yaml.safe_load_all(run.stdout) if d])}
    assert images == {f"{mirror}/etcd:v3.5.17", "elastic-mnist:0.1.0"}, "the project's own is pinned by --image"
    sed = re.search(r'sed "s#(.*?)#(.*?)#"', block)
    seed = SEED.read_text().replace(sed.group(1), sed.group(2).replace("$MIRROR", mirror))
    (seed_image,) = {c["image"] for c in _containers([d for d in yaml.safe_load_all(seed) if d])}
    assert seed_image == f"{mirror}/busybox:1.36.1"
    pushed = re.search(r'for image in (.*?); do', block).group(1).split()
    assert sorted(pushed) == sorted({c["image"] for c in everything} - {"elastic-mnist:0.1.0"})
