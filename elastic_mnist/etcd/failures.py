"""How a failed etcd call is told to the user: one message that names the cause and the fix.

    python -m pytest tests/test_rendezvous_etcd_v3.py -q -k "unreachable or tls or auth"

Apart from client.py (the connection and its retries) so that each stays small; no other module words them.
"""

from __future__ import annotations

import socket
import ssl
from typing import Protocol

import grpc

from elastic_mnist.contract.env import PASSWORD_FILE_ENV, USER_ENV

# Fallbacks for --rdzv-conf user/password_file/secret_file, so secrets stay off command lines (secrets.py).


class EtcdConnectionSpec(Protocol):
    """What a message reads of _client.EtcdConnectionSpec (named here by shape, so that the two modules
    do not import each other)."""

    host: str
    port: int
    protocol: str
    cert: str | None
    user: str | None
    read_timeout: float

    @property
    def endpoint(self) -> str: ...


def rpc_status(exc: BaseException) -> tuple[grpc.StatusCode | None, str]:
    """(code, details) of a gRPC failure; etcd3 wraps some codes in its own exceptions, chaining the original."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, grpc.RpcError) and hasattr(seen, "code"):
            return seen.code(), str(seen.details() or "")
        seen = seen.__cause__ or seen.__context__
    return None, str(exc)


def speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Does host:port answer a TLS ClientHello? Tells "wrong protocol" apart from "nobody there"."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # only asking whether it speaks TLS at all
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=host):
            return True
    except ssl.SSLError as exc:  # a TLS alert (e.g. "certificate required") is still TLS
        return "alert" in str(exc).lower()
    except OSError:
        return False


def failure_message(spec: EtcdConnectionSpec, exc: BaseException, what: str) -> str:
    """What went wrong with etcd, in words that name the fix."""
    code, details = rpc_status(exc)
    where, s = f"etcd at {spec.endpoint}", spec
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        msg = f"{where} did not answer within read_timeout={s.read_timeout:g}s ({what})"
    elif code == grpc.StatusCode.UNAVAILABLE:
        msg = _unavailable(spec, details)
    elif "authentication failed" in details:
        msg = f"{where} rejected user {s.user!r}: wrong user name or password"
    elif "user name is empty" in details or code == grpc.StatusCode.UNAUTHENTICATED:
        msg = (f"{where} requires authentication: pass --rdzv-conf user=NAME,password_file=PATH "
               f"(or set ${USER_ENV} and ${PASSWORD_FILE_ENV})")
    elif "authentication is not enabled" in details:
        msg = f"{where} does not have authentication enabled; drop user/password_file from --rdzv-conf"
    elif code == grpc.StatusCode.PERMISSION_DENIED:
        msg = f"{where}: user {s.user!r} may not {what} ({details}); grant it readwrite on the key prefix"
    else:
        msg = f"{where}: {what} failed: {code.name if code else type(exc).__name__}: {details}"
    return msg

def _unavailable(spec: EtcdConnectionSpec, details: str) -> str:
    where, s, lowered = f"etcd at {spec.endpoint}", spec, details.lower()
    if any(w in lowered for w in ("bad_certificate", "certificate required", "certificate_required")):
        if not s.cert:
            return (f"{where} requires a client certificate (it runs with --client-cert-auth): "
                    "add cert=PATH,key=PATH to --rdzv-conf")
        return f"{where} rejected the client certificate {s.cert!r}: it must be signed by etcd's --trusted-ca-file"
    if any(w in lowered for w in ("ssl", "tls", "handshake", "certificate")):
        return (f"TLS with {where} failed: {details}; check protocol=https and the cacert/cert/key "
                "files (the server certificate must name the endpoint's host)")
    if s.protocol == "http" and "refused" not in lowered and speaks_tls(s.host, s.port, min(2.0, s.read_timeout)):
        return (f"{where} answers with TLS, not plain http: add protocol=https and cacert=PATH "
                "(the CA of etcd's certificate) to --rdzv-conf")
    return f"{where} is unreachable ({details}); is etcd running there? Start one with `elastic-mnist etcd`"

