"""One etcd v3 (gRPC) connection, shared by the etcd-v3 backend, its Store and `elastic-mnist status`.

    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 --rdzv-conf read_timeout=10 ...

Every RPC carries a deadline of `read_timeout` seconds (default 10), so an unreachable etcd surfaces as
ONE error naming the endpoint within that bound (a refused connection: at once). A connection that
breaks (etcd restarted, auth token expired with etcd's --auth-token-ttl) is rebuilt, re-authenticating,
and the call retried once; everything else becomes an `EtcdV3Error` whose message says what to fix.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import etcd3
import etcd3.exceptions
import etcd3.utils
import grpc
from etcd3 import etcdrpc

from elastic_mnist.contract.env import PASSWORD_FILE_ENV, USER_ENV
from elastic_mnist.contract.errors import UserError
from elastic_mnist.contract.rdzv_conf import DEFAULT_KEY_PREFIX, DEFAULT_READ_TIMEOUT_S
from elastic_mnist.etcd.failures import failure_message, rpc_status
from elastic_mnist.files import RefusedFile, read_regular

T = TypeVar("T")
DEFAULT_PORT = 2379
_GRPC_OPTIONS = [
    ("grpc.enable_http_proxy", 0),  # an $http_proxy meant for the internet must not carry rendezvous traffic
    # gRPC's default reconnect backoff grows to 120 s; after an etcd restart we want to be back within ~2 s.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# Worth one reconnect + retry: the channel broke, or the auth token died (etcd restart, token TTL).
_RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.CANCELLED}
_RETRY_DETAILS = ("invalid auth token", "auth store is old")


class EtcdV3Error(UserError):
    """etcd could not be used (unreachable, TLS, credentials, permissions); the message names the fix."""


@dataclass(frozen=True)
class EtcdConnectionSpec:
    """Where etcd is and how to talk to it; `parse` validates everything before any RPC."""

    host: str
    port: int = DEFAULT_PORT
    protocol: str = "http"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a repr, a log or a traceback
    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    outage_timeout: float = 0.0  # how long a client that etcd answered before waits for it to come back

    @property
    def endpoint(self) -> str:
        return f"{self.protocol}://{self.host}:{self.port}"

    @classmethod
    def parse(cls, endpoint: str | None, protocol: str | None = None, read_timeout: float | None = None,
              **options: str | None) -> EtcdConnectionSpec:
        """`host[:port]`, `[v6]:port` or `http(s)://host:port`; a scheme in the endpoint sets the protocol."""
        scheme, host, port = split_endpoint(endpoint)
        spec = cls(host, port, (protocol or scheme or "http").strip().lower(),
                   read_timeout=DEFAULT_READ_TIMEOUT_S if read_timeout is None else float(read_timeout),
                   **options)  # type: ignore[arg-type]
        spec._validate()
        return spec

    def _validate(self) -> None:
        if self.protocol not in ("http", "https"):
            raise EtcdV3Error(f"protocol must be http or https, not {self.protocol!r}")
        if self.read_timeout <= 0:
            raise EtcdV3Error(f"read_timeout must be a positive number of seconds, not {self.read_timeout}")
        if self.outage_timeout < 0:
            raise EtcdV3Error(f"outage_timeout must be 0 or a number of seconds, not {self.outage_timeout}")
        tls_files = {"cacert": self.cacert, "cert": self.cert, "key": self.key}
        if self.protocol == "http" and any(tls_files.values()):
            raise EtcdV3Error("cacert/cert/key given but protocol is http; add protocol=https")
        if bool(self.cert) != bool(self.key):
            raise EtcdV3Error("a client certificate needs both cert=PATH and key=PATH")
        for name, path in tls_files.items():
            if path and not os.path.isfile(path):
                raise EtcdV3Error(f"{name} file {path!r} does not exist or is not a regular file")
        _read(self.key, private=True)  # a private key others may read or change is refused before any connection
        if bool(self.user) != bool(self.password):
            raise EtcdV3Error(f"etcd authentication needs both user=NAME and password_file=PATH "
                              f"(or ${USER_ENV} and ${PASSWORD_FILE_ENV})")


def split_endpoint(endpoint: str | None) -> tuple[str | None, str, int]:
    """(scheme or None, host, port); an empty endpoint means localhost:2379, as in torch's etcd backends."""
    text = (endpoint or "").strip() or f"localhost:{DEFAULT_PORT}"
    scheme, sep, rest = text.partition("://")
    text = (rest if sep else text).rstrip("/")
    if text.startswith("["):  # [::1]:2379
        host, _, tail = text[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    if not host or (port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536)):
        raise EtcdV3Error(f"bad etcd endpoint {endpoint!r}: expected HOST:PORT, e.g. 127.0.0.1:2379")
    return (scheme if sep else None), host, int(port_text or DEFAULT_PORT)


def run_key(key_prefix: str | None, run_id: str, leaf: str) -> str:
    """`{prefix}/{run_id}/{leaf}`, a leaf of contract/keys.py; run ids never share keys."""
    if not run_id or "/" in run_id:  # "a/store" would alias run "a"'s store keys
        raise EtcdV3Error(f"rendezvous id {run_id!r} must be non-empty and contain no '/'")
    prefix = (key_prefix or DEFAULT_KEY_PREFIX).strip("/")
    return f"/{prefix}/{run_id}/{leaf}" if prefix else f"/{run_id}/{leaf}"


TLS_FILE_CAP = 1 << 20  # a CA bundle (the whole Mozilla set is ~220 KB), a certificate chain or a key


def _read(path: str | None, private: bool = False) -> bytes | None:
    """A TLS file's bytes, bounded; a symlink is followed (Kubernetes mounts Secret keys as symlinks). The
    client key (`private`) is a credential: files.credential_problem must trust it."""
    if not path:
        return None
    try:
        return read_regular(path, TLS_FILE_CAP, "TLS file", "give the PEM file itself", follow_symlinks=True,
                            credential=private)
    except RefusedFile as exc:
        raise EtcdV3Error(str(exc)) from None


class EtcdV3Client:
    """Thread-safe holder of an etcd3 client: `call()` runs one operation with error translation."""

    def __init__(self, spec: EtcdConnectionSpec, error_type: type[Exception] = EtcdV3Error) -> None:
        self.spec, self._error_type, self._lock = spec, error_type, threading.Lock()
        self._client: etcd3.MultiEndpointEtcd3Client | None = None
        self._retired: list[etcd3.MultiEndpointEtcd3Client] = []  # closed at close(): other threads may use them
        self._answered: float | None = None  # when etcd last answered (monotonic); once it has, an error
        # is an outage, not a typo
        self.ride_out_outages = True  # False: fail at once (a process on its way out must not wait)
        # Past read_timeout, asked whether others still reach etcd: then it is this host that is cut off.
        self.others_reach_etcd: Callable[[], bool] | None = None
        self._outage_reported = self._cut_off = False

    def _connect(self) -> etcd3.MultiEndpointEtcd3Client:
        s = self.spec
        creds = grpc.ssl_channel_credentials(_read(s.cacert), _read(s.key, private=True), _read(s.cert)) \
            if s.protocol == "https" else None
        # time_retry=0: etcd3 would otherwise refuse to reuse a failed endpoint for 300 s.
        ep = etcd3.Endpoint(s.host, s.port, secure=creds is not None, creds=creds, time_retry=0,
                            opts=_GRPC_OPTIONS)  # type: ignore[arg-type]
        # The constructor authenticates (one RPC) when user/password are set.
        client = etcd3.MultiEndpointEtcd3Client([ep], timeout=s.read_timeout, user=s.user, password=s.password)
        if creds is None:
            # etcd3 sends the token twice: as call credentials and as metadata. gRPC refuses call
            # credentials on a plaintext channel, so over http the metadata copy must do.
            client.call_credentials = None
        return client

    def raw(self) -> etcd3.MultiEndpointEtcd3Client:
        with self._lock:
            if self._client is None:
                try:
                    self._client = self._connect()
                except (grpc.RpcError, etcd3.exceptions.Etcd3Exception) as exc:
                    raise self.translate(exc, "authenticate") from exc
            return self._client

    def _drop(self, client: etcd3.MultiEndpointEtcd3Client) -> None:
        with self._lock:
            if self._client is client:  # another thread may have reconnected already
                self._client = None
                self._retired.append(client)

    def fresh_channel(self) -> None:
        """The next call connects anew; the current channel is closed at close() (others may use it)."""
        client = self._client
        if client is not None:  # one swapped in since by another thread is fresh already
            self._drop(client)

    def answered_within(self, seconds: float) -> bool:
        """Did etcd answer this client in the last `seconds`?"""
        return self._answered is not None and time.monotonic() - self._answered < seconds

    def call(self, what: str, fn: Callable[[etcd3.MultiEndpointEtcd3Client], T]) -> T:
        """One retry on a fresh channel; once etcd has answered us, ride out an outage (an etcd restart, its
        pod rescheduled) for up to outage_timeout (at least read_timeout) before failing: an agent whose
        monitor loop sees one error dies, and a job with stable membership needs no etcd to train."""
        attempt, outage_started = 0, None
        while True:
            attempt += 1
            client = None
            try:
                client = self.raw()
                result = fn(client)
                self._answered, self._outage_reported, self._cut_off = time.monotonic(), False, False
                return result
            except (grpc.RpcError, etcd3.exceptions.Etcd3Exception, self._error_type) as exc:
                code, details = rpc_status(exc)
                transient = code in _RETRY_CODES or any(d in details for d in _RETRY_DETAILS) or (
                    isinstance(exc, self._error_type) and "unreachable" in str(exc))
                transient = transient or (code == grpc.StatusCode.DEADLINE_EXCEEDED and self.spec.outage_timeout > 0)
                if transient and self._answered is not None and self.ride_out_outages:
                    outage_started = outage_started or time.monotonic()
                    if self._keep_waiting(time.monotonic() - outage_started, what):
                        if client is not None:
                            self._drop(client)
                        time.sleep(0.2)
                        continue
                elif transient and attempt == 1 and client is not None:
                    self._drop(client)  # a fresh channel (and token) for the retry
                    continue
                if isinstance(exc, self._error_type):
                    raise
                raise self.translate(exc, what) from exc

    def _keep_waiting(self, elapsed: float, what: str) -> bool:
        s = self.spec
        if elapsed < s.read_timeout:
            return True  # a restart, a blip: as before
        # Once the peers said they still reach etcd, every call of this outage gives up (the keep-alive
        # thread too, which torch's shutdown joins): they may be gone by the time another call asks.
        self._cut_off = self._cut_off or (self.others_reach_etcd is not None and self.others_reach_etcd())
        if elapsed >= s.outage_timeout or self._cut_off:
            return False  # too long, or only we are cut off from etcd: leave as before
        if not self._outage_reported:
            self._outage_reported = True
            print(f"elastic-mnist etcd-v3: warning: etcd at {s.endpoint} has not answered for {elapsed:.0f}s "
                  f"({what}); waiting up to outage_timeout={s.outage_timeout:g}s, training goes on meanwhile",
                  file=sys.stderr, flush=True)
        return True

    def wait_for_change(self, key: str | bytes, after_revision: int, seconds: float, prefix: bool = False) -> bool:
        """Block until `key` (every key under it, with prefix) changes after `after_revision`, or `seconds`
        pass. True on a change; False on timeout or a broken watch: callers re-read either way.

        A raw gRPC watch stream with a deadline, not etcd3's Watcher: that one's thread dies with a
        NameError (`six`) whenever its last watch is cancelled, and then never calls back."""
        k = key if isinstance(key, bytes) else key.encode()
        create = etcdrpc.WatchCreateRequest(key=k, start_revision=after_revision + 1,
                                            range_end=etcd3.utils.prefix_range_end(k) if prefix else b"")
        finished = threading.Event()
        deadline = time.monotonic() + seconds

        def requests() -> Iterator[etcdrpc.WatchRequest]:
            yield etcdrpc.WatchRequest(create_request=create)
            finished.wait()  # keep our half of the stream open until we are done

        client = self.raw()
        stream = etcdrpc.WatchStub(client.channel).Watch(
            requests(), seconds, credentials=client.call_credentials, metadata=client.metadata)
        try:
            for response in stream:
                self._answered = time.monotonic()  # a watch that etcd answers is etcd reachable, too
                if response.events or response.canceled:  # canceled: e.g. revision compacted; no hot loop
                    return bool(response.events) or finished.wait(min(0.2, max(0.0, deadline - time.monotonic())))
            return False
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                finished.wait(max(0.0, deadline - time.monotonic()))  # broken watch: no hot loop
            return False
        finally:
            finished.set()
            stream.cancel()

    def translate(self, exc: BaseException, what: str) -> Exception:
        return self._error_type(failure_message(self.spec, exc, what))

    def close(self) -> None:
        with self._lock:
            clients = [c for c in [self._client, *self._retired] if c is not None]
            self._client, self._retired = None, []
        for c in clients:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing a broken channel must not mask the real outcome
                pass
