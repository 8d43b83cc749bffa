"""Rendezvous you can trust: no code runs from etcd, no password on a command line, a least-privilege etcd.

    python -m pytest tests/test_security.py -q

Everything runs against a real etcd with authentication on; the job tests start real torchrun.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import etcd3
import grpc
import pytest
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2
from etcd_fixtures import etcd_server_auth, rdzv_params, state_bits  # noqa: F401  (etcd_server_auth: a pytest fixture)
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elastic_mnist.compat import private as compat
from elastic_mnist.contract.errors import UserError
from elastic_mnist.etcd.client import EtcdConnectionSpec, EtcdV3Client, EtcdV3Error, run_key
from elastic_mnist.etcd.rdzv_state import StateIntegrityError, is_sealed, seal, unseal
from elastic_mnist.etcd.server import EtcdServer
from elastic_mnist.procs import child_env, wait_for
from elastic_mnist.rendezvous import create_backend, read_rendezvous_status

REPO = Path(__file__).resolve().parents[1]
FAST = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 1, "join_timeout": 120}
# A worker that says it is running, then waits for the test to let it finish.
WORKER = """
import sys, time
from pathlib import Path
Path(sys.argv[1]).write_text("running")
deadline = time.monotonic() + 300
while not Path(sys.argv[2]).exists() and time.monotonic() < deadline:
    time.sleep(0.1)
"""


class Payload:
    """A pickle that, if ever unpickled, creates a marker file: what an attacker would write."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return open, (str(self.marker), "w")


def job_client(server: EtcdServer) -> EtcdV3Client:
    user, password = server.auth  # type: ignore[misc]
    return EtcdV3Client(EtcdConnectionSpec.parse(server.endpoint, user=user, password=password))


@pytest.fixture
def auth_etcd(etcd_server_auth: EtcdServer) -> EtcdServer:  # noqa: F811
    return etcd_server_auth


def start_job(tmp_path: Path, server: EtcdServer, secret: bool, log_level: str = "WARNING") -> subprocess.Popen[str]:
    (tmp_path / "worker.py").write_text(WORKER)
    conf = ["user=elastic-mnist", f"password_file={server.credential_file('job-password')}",
            *([f"secret_file={tmp_path / 'rdzv-secret'}"] if secret else []), *(f"{k}={v}" for k, v in FAST.items())]
    if secret:
        (tmp_path / "rdzv-secret").write_text(os.urandom(32).hex() + "\n")
        (tmp_path / "rdzv-secret").chmod(0o600)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1", "--max-restarts=0",
           "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={server.endpoint}", "--rdzv-id=secure",
           f"--rdzv-conf={','.join(conf)}", "--monitor-interval=0.2", "--local-addr=127.0.0.1",
           str(tmp_path / "worker.py"), str(tmp_path / "running"), str(tmp_path / "release")]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=child_env(LOGLEVEL=log_level))


def finish(job: subprocess.Popen[str], timeout: float = 120) -> tuple[str, str]:
    try:
        return job.communicate(timeout=timeout)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


@pytest.mark.slow
def test_tampered_state_of_a_running_job_is_refused_and_never_executed(tmp_path: Path, auth_etcd: EtcdServer) -> None:
    """The attacker holds the job's etcd credential (any node does) but not its secret."""
    job, marker = start_job(tmp_path, auth_etcd, secret=True), tmp_path / "pwned"
    try:
        wait_for(lambda: (tmp_path / "running").exists() or job.poll() is not None, 120, "the worker to start")
        assert job.poll() is None, finish(job)
        client, key = job_client(auth_etcd), run_key(None, "secure", "state")
        assert is_sealed(client.call("read", lambda c: c.get(key))[0]), "the state is sealed"
        client.call("tamper", lambda c: c.put(key, pickle.dumps(Payload(marker))))
        client.close()
        out, err = finish(job)
    finally:
        (tmp_path / "release").touch()
    assert job.returncode != 0 and not marker.exists(), (out, err)
    pickle.loads(pickle.dumps(Payload(tmp_path / "proof"))).close()  # the payload is live: unpickled, it acts
    assert (tmp_path / "proof").exists()
    lines = [line for line in err.splitlines() if line.startswith("elastic-mnist etcd-v3: error:")]
    assert len(lines) == 1 and "HMAC does not verify" in lines[0] and "Nothing of it was executed" in lines[0], err
    assert "Traceback" not in err or err.index(lines[0]) < err.index("Traceback"), "the error comes first"


def test_without_a_secret_a_malicious_pickle_is_still_refused(tmp_path: Path, auth_etcd: EtcdServer) -> None:
    user, password = auth_etcd.auth  # type: ignore[misc]
    handler = get_rendezvous_handler(rdzv_params(auth_etcd.endpoint, "nosecret", user=user,
                                                 password_file=str(auth_etcd.credential_file("job-password")), **FAST))
    assert handler.next_rendezvous().world_size == 1
    marker, client = tmp_path / "pwned", job_client(auth_etcd)
    client.call("tamper", lambda c: c.put(run_key(None, "nosecret", "state"), pickle.dumps(Payload(marker))))
    client.close()

    def refused() -> RendezvousStateError | None:
        try:
            handler.num_nodes_waiting()  # what torchrun's agent asks on every monitor tick
        except RendezvousStateError as exc:
            return exc
        return None  # still served from the handler's cache of the state

    error = wait_for(refused, 30, "the handler to read the tampered state")
    assert "not torch's rendezvous state" in str(error) and "unexpected class" in str(error)
    assert not marker.exists()
    assert handler.shutdown() is False  # closing reads the state too: refused again, still nothing executed
    assert not marker.exists()
    compat.stop_heartbeats(handler)  # no keep-alive timer outlives the test's etcd


def test_sealed_state_binds_the_secret_and_the_key(tmp_path: Path, auth_etcd: EtcdServer) -> None:
    user, password_file = "elastic-mnist", str(auth_etcd.credential_file("job-password"))
    for name in ("a", "b"):
        (tmp_path / name).write_text(name * 32)
        (tmp_path / name).chmod(0o600)
    conn = {"user": user, "password_file": password_file}
    sealed, _ = create_backend(rdzv_params(auth_etcd.endpoint, "job1", secret_file=str(tmp_path / "a"), **conn))
    leaked = (tmp_path / "a").read_bytes()  # even a valid MAC cannot carry code: the unpickler still checks
    with pytest.raises(StateIntegrityError, match="not torch's rendezvous state"):
        unseal(leaked, sealed.key, seal(leaked, sealed.key, pickle.dumps(Payload(tmp_path / "pwned"))))
    assert not (tmp_path / "pwned").exists()
    good = state_bits(0)
    assert sealed.set_state(good)[0] == good
    # A node whose secret differs, or that has none, fails when its handler is created (the first read).
    with pytest.raises(StateIntegrityError, match="HMAC does not verify"):
        create_backend(rdzv_params(auth_etcd.endpoint, "job1", secret_file=str(tmp_path / "b"), **conn))
    with pytest.raises(StateIntegrityError, match="sealed with a secret but this node has none"):
        create_backend(rdzv_params(auth_etcd.endpoint, "job1", **conn))
    client = job_client(auth_etcd)  # a valid sealed state copied into another job's key does not verify there
    client.call("copy", lambda c: c.put(run_key(None, "job2", "state"), c.get(sealed.key)[0]))
    client.close()
    with pytest.raises(StateIntegrityError, match="HMAC does not verify"):
        create_backend(rdzv_params(auth_etcd.endpoint, "job2", secret_file=str(tmp_path / "a"), **conn))
    status = read_rendezvous_status(auth_etcd.endpoint, "job1", secret_file=str(tmp_path / "a"), **conn)
    assert status["integrity"] == "verified" and status["round"] == 0
    assert read_rendezvous_status(auth_etcd.endpoint, "job1", **conn)["integrity"].startswith("unverified")


def all_cmdlines() -> dict[int, str]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass  # exited meanwhile
    return found


@pytest.mark.slow
def test_the_password_is_on_no_command_line_and_in_no_log(tmp_path: Path, auth_etcd: EtcdServer) -> None:
    password = auth_etcd.auth[1]  # type: ignore[index]
    job = start_job(tmp_path, auth_etcd, secret=True, log_level="INFO")
    try:
        wait_for(lambda: (tmp_path / "running").exists() or job.poll() is not None, 120, "the worker to start")
        assert job.poll() is None, finish(job)
        cmdlines = all_cmdlines()
        assert any("password_file=" in c for c in cmdlines.values()), "the run's torchrun is among them"
        assert not [pid for pid, c in cmdlines.items() if password in c]
        (tmp_path / "release").touch()
        out, err = finish(job)
    finally:
        (tmp_path / "release").touch()
    assert job.returncode == 0, err
    assert "rdzv_configs" in err and "'password_file'" in err, "torchrun logs its --rdzv-conf at INFO"
    logs = {"stdout": out, "stderr": err, "etcd log": auth_etcd.log_path.read_text(errors="replace")}
    assert not [name for name, text in logs.items() if password in text]


def test_password_on_the_command_line_still_works_but_warns_once(auth_etcd: EtcdServer,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    import elastic_mnist.etcd.secrets as secrets_module

    secrets_module._warned_password = False
    user, password = auth_etcd.auth  # type: ignore[misc]
    for _ in range(2):
        create_backend(rdzv_params(auth_etcd.endpoint, user=user, password=password))
    warnings = [line for line in capfd.readouterr().err.splitlines() if "password= in --rdzv-conf" in line]
    assert len(warnings) == 1 and "password_file=PATH" in warnings[0] and password not in warnings[0]


def test_credentials_come_from_the_environment(auth_etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_MNIST_ETCD_USER", "elastic-mnist")
    monkeypatch.setenv("ELASTIC_MNIST_ETCD_PASSWORD_FILE", str(auth_etcd.credential_file("job-password")))
    backend, _ = create_backend(rdzv_params(auth_etcd.endpoint, "from-env"))
    assert backend.get_state() is None
    monkeypatch.setenv("ELASTIC_MNIST_ETCD_PASSWORD_FILE", "/nonexistent/job-password")
    with pytest.raises(UserError, match=r"cannot read the etcd password file '/nonexistent/job-password' "
                                        r"\(from \$ELASTIC_MNIST_ETCD_PASSWORD_FILE\)"):
        create_backend(rdzv_params(auth_etcd.endpoint, "from-env"))


def test_status_command_reads_credentials_and_secret_from_the_environment(tmp_path: Path,
                                                                          auth_etcd: EtcdServer) -> None:
    (tmp_path / "secret").write_text("s" * 32)
    (tmp_path / "secret").chmod(0o600)
    env = child_env(ELASTIC_MNIST_ETCD_USER="elastic-mnist", ELASTIC_MNIST_RDZV_SECRET_FILE=str(tmp_path / "secret"),
                    ELASTIC_MNIST_ETCD_PASSWORD_FILE=str(auth_etcd.credential_file("job-password")))
    conn = {"user": "elastic-mnist", "password_file": env["ELASTIC_MNIST_ETCD_PASSWORD_FILE"]}
    backend, _ = create_backend(rdzv_params(auth_etcd.endpoint, "watched", secret_file=str(tmp_path / "secret"),
                                            **conn))
    backend.set_state(state_bits(0))
    cmd = [sys.executable, "-m", "elastic_mnist", "status", "--rdzv-endpoint", auth_etcd.endpoint,
           "--rdzv-id", "watched"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert result.returncode == 0 and "round 0, joining; 0 participant(s) (state verified)" in result.stdout, result
    (tmp_path / "secret").write_text("t" * 32)  # another job's secret: the state does not verify
    (tmp_path / "secret").chmod(0o600)
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert result.returncode == 2 and "HMAC does not verify" in result.stderr and result.stderr.count("\n") == 1


def admin_rpc(client: etcd3.Etcd3Client, name: str, request: object) -> object:
    return getattr(client.authstub, name)(request, 10, credentials=client.call_credentials, metadata=client.metadata)


def test_the_job_credential_is_limited_to_its_prefix_and_cannot_manage_users(auth_etcd: EtcdServer) -> None:
    root_file, job_file = auth_etcd.credential_file("root-password"), auth_etcd.credential_file("job-password")
    assert root_file.stat().st_mode & 0o777 == 0o600 and job_file.stat().st_mode & 0o777 == 0o600
    root_password, job_password = root_file.read_text().strip(), job_file.read_text().strip()
    assert root_password != job_password and auth_etcd.auth == ("elastic-mnist", job_password)
    job = job_client(auth_etcd)
    job.call("put inside", lambda c: c.put("/torchelastic/v3/run/state", b"ok"))
    assert job.call("get inside", lambda c: c.get("/torchelastic/v3/run/state"))[0] == b"ok"
    outside = [lambda c: c.put("/other", b"x"), lambda c: c.get("/other"), lambda c: list(c.get_all()),
               lambda c: c.put("/torchelastic", b"x"), lambda c: c.delete_prefix("/")]
    for attempt in outside:
        with pytest.raises(EtcdV3Error, match="permission denied"):
            job.call("step outside", attempt)
    raw = job.raw()
    escalate = auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=b"\0", range_end=b"\0")
    for name, request in [("UserAdd", etcdrpc.AuthUserAddRequest(name="mallory", password="x")),
                          ("RoleAdd", etcdrpc.AuthRoleAddRequest(name="mallory")),
                          ("RoleGrantPermission", etcdrpc.AuthRoleGrantPermissionRequest(
                              name="elastic-mnist-rendezvous", perm=escalate)),
                          ("UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user="elastic-mnist", role="root")),
                          ("AuthDisable", etcdrpc.AuthDisableRequest())]:
        with pytest.raises(grpc.RpcError, match="permission denied"):
            admin_rpc(raw, name, request)
    job.close()
    root = EtcdV3Client(EtcdConnectionSpec.parse(auth_etcd.endpoint, user="root", password=root_password))
    root.call("put as root", lambda c: c.put("/other", b"root may"))
    root.close()


def test_auth_setup_is_idempotent_across_restarts(tmp_path: Path) -> None:
    with EtcdServer(tmp_path / "etcd", enable_v2=False, auth=True) as first:
        before = {n: first.credential_file(n).read_text() for n in ("root-password", "job-password")}
    with EtcdServer(tmp_path / "etcd", enable_v2=False, auth=True) as second:  # same data dir, new ports
        assert {n: second.credential_file(n).read_text() for n in before} == before
        job = job_client(second)
        job.call("put inside", lambda c: c.put("/torchelastic/v3/x", b"1"))
        with pytest.raises(EtcdV3Error, match="permission denied"):
            job.call("step outside", lambda c: c.put("/other", b"x"))
        job.close()
