"""Read a job's rendezvous state from etcd without joining it: the data behind `elastic-mnist status`.

    elastic-mnist status --rdzv-endpoint 127.0.0.1:2379 --rdzv-id job1
    >>> read_rendezvous_status("127.0.0.1:2379", "job1")                    # --rdzv-backend=etcd-v3
    >>> read_rendezvous_status("127.0.0.1:2379", "job1", backend="etcd")    # torch's legacy v2 backend

etcd-v3 state is torch's pickled `_RendezvousState`. It is decoded by the backend's restricted
unpickler (_state.py), mapped onto plain stand-ins: no torch import (status stays fast), and no
arbitrary code runs from whatever someone wrote into etcd. A sealed state is verified when the job's
secret is given (secret_file=PATH or $ELASTIC_MNIST_RDZV_SECRET_FILE), else shown as unverified.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from elastic_mnist.contract.keys import CONFIG_ERROR_KEY, STATE_LEAF, STORE_LEAF
from elastic_mnist.contract.rdzv_conf import SCHEMA, check_keys, check_values
from elastic_mnist.etcd.client import EtcdV3Client, EtcdV3Error, run_key
from elastic_mnist.etcd.rdzv_state import (
    NodeDesc,
    RendezvousState,
    StateIntegrityError,
    decode_state,
    is_sealed,
    open_lineage,
    unseal,
)
from elastic_mnist.etcd.secrets import connection_spec, secret

LEGACY_PREFIX = "/torchelastic/p2p"  # torch's etcd_rendezvous default etcd_prefix
__all__ = ["SCHEMA", "NodeDesc", "RendezvousState", "decode_state", "read_rendezvous_status"]


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t else None


def _dynamic_status(state: RendezvousState) -> dict[str, Any]:
    nodes = sorted(state.participants, key=lambda n: state.participants[n])
    return {
        "round": state.round,
        "phase": "closed" if state.closed else "complete" if state.complete else "joining",
        "deadline": _iso(state.deadline),
        "participants": [{"node": repr(n), "rank": state.participants[n],
                          "last_heartbeat": _iso(state.last_heartbeats.get(n))} for n in nodes],
        "waiting": sorted(repr(n) for n in state.wait_list),
        "redundant": sorted(repr(n) for n in state.redundancy_list),
    }


def _integrity(key: str, stored: bytes, job_secret: bytes | None) -> str:
    if job_secret is not None:
        unseal(job_secret, key, stored)  # raises StateIntegrityError naming the cause
        return "verified"
    return "unverified (sealed; pass secret_file=PATH to verify)" if is_sealed(stored) else "unsealed"


def _read_etcd_v3(endpoint: str, run_id: str, key_prefix: str | None, **conn: Any) -> dict[str, Any]:
    key = run_key(key_prefix, run_id, STATE_LEAF)
    error_key = f"{run_key(key_prefix, run_id, STORE_LEAF)}/{CONFIG_ERROR_KEY}"
    job_secret = secret(conn.pop("secret_file", None))
    client = EtcdV3Client(connection_spec(endpoint, conn))
    try:
        resp, error = [client.call("read the rendezvous state", lambda c, k=k: c.get_response(k))
                       for k in (key, error_key)]
    finally:
        client.close()
    if not resp.kvs:
        return {"key": key, "found": False}
    stored = resp.kvs[0].value
    integrity = _integrity(key, stored, job_secret)
    status = _dynamic_status(decode_state(stored))
    if error.kvs:
        status["config_error"] = _config_error(error_key, error.kvs[0].value, job_secret)
    return {"key": key, "found": True, "token": int(resp.kvs[0].mod_revision), "integrity": integrity, **status}


def _config_error(key: str, stored: bytes, job_secret: bytes | None) -> str:
    """The line a worker's configuration error closed the job with, when this reader can trust it."""
    if job_secret is None and is_sealed(stored):
        return "(sealed with the job's secret: pass secret_file=PATH to read it)"
    try:
        return open_lineage(job_secret, key, stored)[0].decode(errors="replace")
    except StateIntegrityError as exc:
        return f"(not readable: {exc})"


def _read_legacy_etcd(endpoint: str, run_id: str, key_prefix: str | None, **conn: Any) -> dict[str, Any]:
    import etcd  # python-etcd: the v2 API that torch's `etcd` backend uses

    conn.pop("secret_file", None)  # the legacy backend's state is JSON, not sealed
    spec = connection_spec(endpoint, conn)
    cert = (spec.cert, spec.key) if spec.cert else None
    client = etcd.Client(host=spec.host, port=spec.port, protocol=spec.protocol, cert=cert, ca_cert=spec.cacert,
                         username=spec.user, password=spec.password, read_timeout=spec.read_timeout)
    key = f"{(key_prefix or LEGACY_PREFIX).rstrip('/')}/run_{run_id}/rdzv/active_version"
    try:
        state = json.loads(client.read(key).value)
    except etcd.EtcdKeyNotFound:
        return {"key": key, "found": False}
    except etcd.EtcdException as exc:
        raise EtcdV3Error(f"etcd v2 API at {spec.endpoint}: {exc} (is etcd running with --enable-v2?)") from exc
    phase = {"final": "complete", "closed": "closed"}.get(state.get("status"), "joining")
    return {"key": key, "found": True, "round": int(state.get("version", -1)), "phase": phase,
            "legacy_status": state.get("status"),
            "participants": [{"node": None, "rank": r, "last_heartbeat": None} for r in state.get("participants", [])],
            "waiting": [], "num_waiting": int(state.get("num_workers_waiting", 0))}


def read_rendezvous_status(endpoint: str, run_id: str, backend: str = "etcd-v3", key_prefix: str | None = None,
                           **conn: Any) -> dict[str, Any]:
    """Round, phase, participants (with ranks and heartbeats) and waiting nodes of one job.

    conn: any --rdzv-conf key of conf.SCHEMA (the connection ones and secret_file are used).
    Keys always present: backend, endpoint, run_id, key, found; when found also round, phase
    ("joining" | "complete" | "closed"), participants [{node, rank, last_heartbeat}], waiting; and
    config_error, the line the job ended with, when a worker's configuration error closed it (etcd-v3).
    """
    readers = {"etcd-v3": _read_etcd_v3, "etcd": _read_legacy_etcd}
    check_keys(conn)
    check_values(conn)
    if backend not in readers:
        raise EtcdV3Error(f"status reads the etcd-v3 or etcd backends, not {backend!r}")
    result = readers[backend](endpoint, run_id, key_prefix, **conn)
    return {"backend": backend, "endpoint": endpoint, "run_id": run_id, **result}
