"""The trainer pod of a rendered Job run without a cluster, as local processes against a real etcd: what the
kubelet would fill in is substituted (tests/e2e/test_k8s_lifecycle.py's docstring says what), for the
lifecycle and stop tests.

    from e2e.k8s_local import Cluster, etcd_for
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from conftest import load_render
from k8s_manifests import argv, container, find, pod_spec, resolve_env, trainer_job, under

from elastic_mnist import procs
from elastic_mnist.config import TrainConfig
from elastic_mnist.etcd.server import EtcdServer
from elastic_mnist.state import snapshots

render = load_render()
REPO = Path(__file__).resolve().parents[2]
RUN_FLAGS = ["--global-batch-size=64", "--checkpoint-every=10", "--log-every=10", "--collective-timeout=20"]
DROPPED_ENV = ("ELASTIC_MNIST_ETCD_USER", "ELASTIC_MNIST_ETCD_PASSWORD_FILE")


def rendered(variant: str) -> list[dict]:
    """k8s/ as committed for the default; any other variant rendered from the sources."""
    if variant == render.DEFAULT_OVERLAY:
        return [d for docs in render.load_dir(REPO / "k8s").values() for d in docs]
    return render.render(variant)


class LocalPod:
    """One pod of the trainer Job as processes: init containers in order, then the trainer container."""

    def __init__(self, job: dict, index: int, root: Path, endpoint: str, mnist: str, uid: str, flags: list[str],
                 dropped_env: tuple[str, ...] = ()):
        self.job, self.index, self.root, self.endpoint, self.mnist, self.uid = job, index, root, endpoint, mnist, uid
        self.flags, self.dropped_env = flags, dropped_env
        self.tmp = root / f"pod-{index}-tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.log_path = root / f"pod-{index}.log"
        self.proc: subprocess.Popen | None = None
        self.backend: str | None = "gloo"  # this machine has no GPU; None keeps the manifest's --backend

    def _path(self, value: str) -> str:
        for mount, local in (("/data/mnist", self.mnist), ("/data", str(self.root / "data")),
                             ("/tmp", str(self.tmp)), ("/etc/elastic-mnist/etcd-tls", str(self.root / "tls")),
                             ("/etc/elastic-mnist/etcd", str(self.root / "secret"))):
            if under(value, mount):
                return local + value[len(mount):]
        return value

    def _arg(self, arg: str) -> str:
        name, sep, value = arg.partition("=")
        if name == "--rdzv-endpoint":
            return f"{name}={self.endpoint}"
        if name == "--backend" and self.backend:
            return f"--backend={self.backend}"
        if name == "--rdzv-conf":  # key=PATH entries (cacert=...) name files on the pod's volumes too
            entries = (e.partition("=") for e in value.split(","))
            return f"{name}=" + ",".join(f"{k}={self._path(v)}" for k, _, v in entries)
        return f"{name}={self._path(value)}" if sep else arg

    def command(self, c: dict) -> tuple[list[str], dict[str, str]]:
        kw = {"pod_name": f"trainer-{self.index}", "pod_ip": "127.0.0.1", "uid": self.uid}
        args = [self._arg(a) for a in argv(self.job, c, **kw)] + self.flags
        args[0] = shutil.which(args[0], path=str(Path(sys.executable).parent))
        env = {k: self._path(v) for k, v in resolve_env(self.job, c, **kw).items() if k not in self.dropped_env}
        env.update(JOB_COMPLETION_INDEX=str(self.index), TMPDIR=str(self.tmp))
        return args, procs.child_env(**env)

    def _popen(self, c: dict) -> subprocess.Popen:
        args, env = self.command(c)
        with open(self.log_path, "a") as log:
            log.write(f"=== {c['name']}: {' '.join(args)}\n")
            log.flush()
            return subprocess.Popen(args, env=env, cwd=self.tmp, stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=procs.die_with_parent_preexec())

    def start_init(self) -> subprocess.Popen:
        (init,) = [c for c in pod_spec(self.job)["initContainers"] if c["name"] == "preflight"]
        self.proc = self._popen(init)
        return self.proc

    def start_trainer(self) -> subprocess.Popen:
        self.proc = self._popen(container(self.job, "trainer"))
        return self.proc

    def plain_torchrun(self, timeout: float = 60) -> subprocess.CompletedProcess:
        """The trainer container's torchrun arguments run by torchrun itself, without `elastic-mnist pod`."""
        args, env = self.command(container(self.job, "trainer"))
        launcher = args[2:args.index("-m")]
        module, program = args[args.index("-m") + 1], args[args.index("-m") + 2:]
        return subprocess.run(procs.torchrun_command(launcher, program, module), env=env, cwd=self.tmp,
                              capture_output=True, text=True, timeout=timeout)

    def run(self, timeout: float = 300) -> tuple[int, str | None]:
        """(exit code, the container that gave it): the kubelet's order, init first."""
        code = self.start_init().wait(timeout)
        if code != 0:
            return code, "preflight"
        return self.start_trainer().wait(timeout), "trainer"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def container_log(self, name: str) -> list[str]:
        """The lines of the latest run of one container (what `kubectl logs -c NAME` shows)."""
        section = self.log().split(f"=== {name}: ")[-1].split("\n=== ")[0]
        return section.splitlines()[1:]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            procs.signal_tree(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Cluster:
    """The pods of one Job object (one UID) against one etcd, with their shared /data."""

    def __init__(self, variant: str, root: Path, server: EtcdServer, mnist: str, steps: int, pace: float = 0.0):
        self.docs = rendered(variant)
        self.job, self.root, self.server, self.mnist = trainer_job(self.docs), root, server, mnist
        self.uid = str(uuid.uuid4())
        self.flags = RUN_FLAGS + [f"--max-steps={steps}", f"--min-step-time={pace}"]
        self.pods: list[LocalPod] = []
        secret_dir = root / "secret"  # the Secret elastic-mnist-etcd, as mounted
        secret_dir.mkdir(parents=True, exist_ok=True)
        (secret_dir / "rdzv-secret").write_text(secrets.token_hex(32))
        (secret_dir / "rdzv-secret").chmod(0o600)
        if server.auth:
            shutil.copy(server.credential_file("job-password"), secret_dir / "job-password")
        self.dropped_env = () if server.auth else DROPPED_ENV

    def pod(self, index: int, endpoint: str | None = None) -> LocalPod:
        p = LocalPod(self.job, index, self.root, endpoint or self.server.endpoint, self.mnist, self.uid, self.flags,
                     self.dropped_env)
        self.pods.append(p)
        return p

    def job_dir(self, kind: str) -> Path:
        name = self.job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"]
        return self.root / "data" / kind / name

    def summary(self) -> dict:
        return json.loads((self.job_dir("runs") / "summary.json").read_text())

    def logs(self) -> str:
        return "\n".join(f"--- pod {p.index}\n{p.log()[-4000:]}" for p in self.pods)

    def close(self) -> None:
        """Kill the pods; what their /dev/shm held goes too (a pod's own memory volume ends with it, this
        machine's /dev/shm does not: the test owns the run directory its killed pods left there)."""
        for p in self.pods:
            p.kill()
        if self.pods:
            shutil.rmtree(Path(snapshots.root_of(TrainConfig().snapshot_dir)) / snapshots.run_name(self.uid),
                          ignore_errors=True)


def etcd_for(variant: str) -> EtcdServer:
    """etcd configured like the variant's: the v2 API only for the legacy backend, which also has no auth."""
    etcd = find(rendered(variant), "StatefulSet", "etcd")
    v2 = resolve_env(etcd, container(etcd, "etcd"), pod_name="etcd-0")["ETCD_ENABLE_V2"] == "true"
    return EtcdServer(enable_v2=v2, auth=None if v2 else True)


def run_together(pods: list[LocalPod], timeout: float = 420) -> list[tuple[int, str]]:
    """Start every pod's init container, then each trainer as its init container succeeds."""
    for p in pods:
        p.start_init()
    results = [p.proc.wait(timeout) for p in pods]
    if any(results):
        return [(code, "preflight") for code in results]
    for p in pods:
        p.start_trainer()
    return [(p.proc.wait(timeout), "trainer") for p in pods]
