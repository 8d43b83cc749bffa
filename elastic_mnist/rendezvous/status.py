"""Read a job's rendezvous state from etcd without joining it: the data behind `elastic-mnist status`.

    elastic-mnist status --rdzv-endpoint 127.0.0.1:2379 --rdzv-id job1
    >>> read_rendezvous_status("127.0.0.1:2379", "job1")                    # --rdzv-backend=etcd-v3
    >>> read_rendezvous_status("127.0.0.1:2379", "job1", backend="etcd")    # torch's legacy v2 backend

etcd-v3 state is torch's pickled `_RendezvousState`. It is decoded by a restricted unpickler that
admits only the classes that state is made of, mapped onto the plain stand-ins below: no torch import
(status stays fast), and no arbitrary code runs from whatever someone wrote into etcd.
"""

from __future__ import annotations

import io
import json
import pickle
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from elastic_mnist.rendezvous._client import EtcdConnectionSpec, EtcdV3Client, EtcdV3Error, run_key

_DYNAMIC = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
LEGACY_PREFIX = "/torchelastic/p2p"  # torch's etcd_rendezvous default etcd_prefix


@dataclass(eq=True, order=True, frozen=True)
class NodeDesc:
    """Stand-in for torch's _NodeDesc: same fields, same `addr_pid_localid` rendering."""

    addr: str = ""
    pid: int = 0
    local_id: int = 0

    def __repr__(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}"


@dataclass
class RendezvousState:
    """Stand-in for torch's _RendezvousState (attributes restored from the pickle)."""

    round: int = 0
    complete: bool = False
    deadline: datetime | None = None
    closed: bool = False
    participants: dict[NodeDesc, int] = field(default_factory=dict)
    wait_list: set[NodeDesc] = field(default_factory=set)
    redundancy_list: set[NodeDesc] = field(default_factory=set)
    last_heartbeats: dict[NodeDesc, datetime] = field(default_factory=dict)


_ALLOWED = {
    (_DYNAMIC, "_RendezvousState"): RendezvousState,
    (_DYNAMIC, "_NodeDesc"): NodeDesc,
    ("datetime", "datetime"): datetime,
    ("datetime", "timezone"): timezone,
    ("datetime", "timedelta"): timedelta,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"unexpected class {module}.{name} in rendezvous state") from None


def decode_state(state_bits: bytes) -> RendezvousState:
    """torch's pickled _RendezvousState -> RendezvousState, admitting nothing else."""
    state = _StateUnpickler(io.BytesIO(state_bits)).load()
    if not isinstance(state, RendezvousState):
        raise pickle.UnpicklingError(f"rendezvous state is a {type(state).__name__}, not _RendezvousState")
    return state


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


def _read_etcd_v3(endpoint: str, run_id: str, key_prefix: str | None, **conn: Any) -> dict[str, Any]:
    key = run_key(key_prefix, run_id, "state")
    client = EtcdV3Client(EtcdConnectionSpec.parse(endpoint, **conn))
    try:
        resp = client.call("read the rendezvous state", lambda c: c.get_response(key))
    finally:
        client.close()
    if not resp.kvs:
        return {"key": key, "found": False}
    status = _dynamic_status(decode_state(resp.kvs[0].value))
    return {"key": key, "found": True, "token": int(resp.kvs[0].mod_revision), **status}


def _read_legacy_etcd(endpoint: str, run_id: str, key_prefix: str | None, **conn: Any) -> dict[str, Any]:
    import etcd  # python-etcd: the v2 API that torch's `etcd` backend uses

    spec = EtcdConnectionSpec.parse(endpoint, **conn)
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

    conn: protocol, cacert, cert, key, user, password, read_timeout (as in --rdzv-conf).
    Keys always present: backend, endpoint, run_id, key, found; when found also round, phase
    ("joining" | "complete" | "closed"), participants [{node, rank, last_heartbeat}], waiting.
    """
    readers = {"etcd-v3": _read_etcd_v3, "etcd": _read_legacy_etcd}
    if backend not in readers:
        raise EtcdV3Error(f"status reads the etcd-v3 or etcd backends, not {backend!r}")
    result = readers[backend](endpoint, run_id, key_prefix, **conn)
    return {"backend": backend, "endpoint": endpoint, "run_id": run_id, **result}
