"""Turn on etcd authentication for an embedded server: what `EtcdServer(auth=(user, password))` does.

    with EtcdServer(auth=("root", "secret")) as etcd:   # then --rdzv-conf user=root,password=secret
        ...

The same steps as `etcdctl user add root && etcdctl auth enable`, over gRPC so no etcdctl is needed.
Idempotent: a data dir that already has auth enabled (a restart) is left as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from elastic_mnist.errors import UserError
from elastic_mnist.rendezvous._client import EtcdConnectionSpec, EtcdV3Client, EtcdV3Error, rpc_status

if TYPE_CHECKING:
    from elastic_mnist.etcd_server import EtcdServer

RENDEZVOUS_ROLE = "rendezvous"


def _spec(server: EtcdServer, user: str | None = None, password: str | None = None) -> EtcdConnectionSpec:
    tls = server.tls or {}
    client_pair = tls.get("client_cert_file", tls.get("cert_file")), tls.get("client_key_file", tls.get("key_file"))
    use_pair = bool(tls.get("trusted_ca_file"))  # the server demands client certificates
    return EtcdConnectionSpec.parse(
        f"127.0.0.1:{server.port}" if server.host in ("0.0.0.0", "::", "") else server.endpoint,
        "https" if server.tls else "http",
        cacert=tls.get("trusted_ca_file") or tls.get("ca_file"),
        cert=client_pair[0] if use_pair else None, key=client_pair[1] if use_pair else None,
        user=user, password=password)


def _already_enabled(server: EtcdServer, user: str, password: str) -> bool:
    client = EtcdV3Client(_spec(server, user, password))
    try:
        client.raw()  # authenticates
        return True
    except EtcdV3Error as exc:
        if "authentication is not enabled" in rpc_status(exc)[1]:
            return False
        raise UserError(f"etcd in {server.data_dir} already has authentication enabled and rejects "
                        f"{user!r}: {exc}") from exc
    finally:
        client.close()


def enable_auth(server: EtcdServer, user: str, password: str) -> None:
    """Create `root` (and `user` with readwrite on every key, if not root) and enable auth."""
    if _already_enabled(server, user, password):
        return
    client = EtcdV3Client(_spec(server))
    stub = client.raw().authstub
    timeout = client.spec.read_timeout
    try:
        stub.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=password), timeout)
        stub.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"), timeout)
        stub.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout)
        if user != "root":
            everything = auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=b"\0", range_end=b"\0")
            stub.UserAdd(etcdrpc.AuthUserAddRequest(name=user, password=password), timeout)
            stub.RoleAdd(etcdrpc.AuthRoleAddRequest(name=RENDEZVOUS_ROLE), timeout)
            stub.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(name=RENDEZVOUS_ROLE, perm=everything),
                                     timeout)
            stub.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=user, role=RENDEZVOUS_ROLE), timeout)
        stub.AuthEnable(etcdrpc.AuthEnableRequest(), timeout)
    except grpc.RpcError as exc:
        raise UserError(f"could not enable etcd authentication: {client.translate(exc, 'enable auth')}") from exc
    finally:
        client.close()
