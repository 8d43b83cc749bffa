"""Least-privilege etcd authentication: root for the operator, a job user limited to the rendezvous prefix.

    elastic-mnist etcd --auth                        # the embedded etcd, through EtcdServer(auth=...)
    elastic-mnist etcd-auth --endpoint etcd-client:2379 --root-password-file F --password-file F   # any etcd

`ensure_auth` makes etcd converge on: user `root` (role root) with the operator's password; user
`elastic-mnist` whose only role grants readwrite on the job key prefixes (`/torchelastic/` by default,
which holds every etcd-v3 run's state and store keys) and nothing else (no other keys, no user or
role management); authentication enabled. The same steps as `etcdctl user add / role add /
role grant-permission --prefix / auth enable`, over gRPC so no etcdctl is needed.

Idempotent: on a restart (auth already on) it logs in as root and re-applies the job user's password,
role and permissions, revoking anything else granted to them; several callers at once (the members
of a three-member etcd) tolerate each other's "already exists".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import etcd3
import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from elastic_mnist.contract.errors import UserError
from elastic_mnist.etcd.client import EtcdConnectionSpec, EtcdV3Client, EtcdV3Error, rpc_status

JOB_USER = "elastic-mnist"
JOB_ROLE = "elastic-mnist-rendezvous"
JOB_PREFIXES = ("/torchelastic/",)  # the etcd-v3 backend's default key_prefix is /torchelastic/v3
_TOLERATED = ("already exists", "already granted")


@dataclass(frozen=True)
class JobAccount:
    """The etcd user every node of a job logs in as, and the key prefixes it may read and write."""

    user: str
    password: str
    prefixes: tuple[str, ...] = JOB_PREFIXES

    def __post_init__(self) -> None:
        if self.user == "root":
            raise UserError("the job's etcd user must not be root (root can manage users and roles); "
                            f"use a user of its own, e.g. {JOB_USER!r}")
        if not self.prefixes or any(not p.startswith("/") or p == "/" for p in self.prefixes):
            raise UserError(f"job key prefixes must be absolute and narrower than '/', not {self.prefixes}")


class _Admin:
    """Auth RPCs on one connection: as root when auth is on, anonymous while it is still off."""

    def __init__(self, spec: EtcdConnectionSpec, root_password: str) -> None:
        self.enabled = True
        self.client = EtcdV3Client(replace(spec, user="root", password=root_password))
        try:
            self.client.raw()
        except EtcdV3Error as exc:
            self.client.close()
            if "authentication is not enabled" not in rpc_status(exc)[1]:
                if "wrong user name or password" in str(exc):
                    raise UserError(f"etcd at {spec.endpoint} already has authentication enabled and refuses "
                                    "this root password: use the root password it was set up with") from None
                raise
            self.enabled, self.client = False, EtcdV3Client(spec)

    def rpc(self, name: str, request: Any, tolerate: bool = False) -> Any:
        raw: etcd3.MultiEndpointEtcd3Client = self.client.raw()
        try:
            return getattr(raw.authstub, name)(request, self.client.spec.read_timeout,
                                               credentials=raw.call_credentials, metadata=raw.metadata)
        except grpc.RpcError as exc:
            if tolerate and any(t in rpc_status(exc)[1] for t in _TOLERATED):
                return None
            raise UserError(f"setting up etcd authentication ({name}) failed: "
                            f"{self.client.translate(exc, name)}") from None


def _prefix_end(prefix: str) -> bytes:
    return etcd3.utils.prefix_range_end(prefix.encode())


def _ensure_user(admin: _Admin, name: str, password: str, role: str) -> None:
    """Create or re-password the user and leave it with exactly one role."""
    if admin.rpc("UserAdd", etcdrpc.AuthUserAddRequest(name=name, password=password), tolerate=True) is None:
        admin.rpc("UserChangePassword", etcdrpc.AuthUserChangePasswordRequest(name=name, password=password))
    admin.rpc("RoleAdd", etcdrpc.AuthRoleAddRequest(name=role), tolerate=True)
    admin.rpc("UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user=name, role=role), tolerate=True)
    for other in admin.rpc("UserGet", etcdrpc.AuthUserGetRequest(name=name)).roles:
        if other != role:
            admin.rpc("UserRevokeRole", etcdrpc.AuthUserRevokeRoleRequest(name=name, role=other))


def _ensure_job_role(admin: _Admin, prefixes: tuple[str, ...]) -> None:
    """readwrite on each prefix, and no other permission."""
    wanted = {(p.encode(), _prefix_end(p)) for p in prefixes}
    admin.rpc("RoleAdd", etcdrpc.AuthRoleAddRequest(name=JOB_ROLE), tolerate=True)
    for perm in admin.rpc("RoleGet", etcdrpc.AuthRoleGetRequest(role=JOB_ROLE)).perm:
        if (perm.key, perm.range_end) not in wanted or perm.permType != auth_pb2.Permission.READWRITE:
            admin.rpc("RoleRevokePermission", etcdrpc.AuthRoleRevokePermissionRequest(
                role=JOB_ROLE, key=perm.key, range_end=perm.range_end))
    for key, end in sorted(wanted):
        perm = auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=key, range_end=end)
        admin.rpc("RoleGrantPermission", etcdrpc.AuthRoleGrantPermissionRequest(name=JOB_ROLE, perm=perm))


def ensure_auth(spec: EtcdConnectionSpec, root_password: str, job: JobAccount) -> None:
    """Converge etcd at `spec` (no user in it) on root + the job user, and enable authentication."""
    admin = _Admin(spec, root_password)
    try:
        if not admin.enabled:  # when it is on, we just logged in as root with this very password
            _ensure_user(admin, "root", root_password, "root")
        _ensure_job_role(admin, job.prefixes)
        _ensure_user(admin, job.user, job.password, JOB_ROLE)
        if not admin.enabled:
            admin.rpc("AuthEnable", etcdrpc.AuthEnableRequest())
    finally:
        admin.client.close()
