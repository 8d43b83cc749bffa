"""What may come out of a rendezvous state key: torch's pickled `_RendezvousState`, checked before use.

    torchrun --rdzv-backend=etcd-v3 --rdzv-conf secret_file=/etc/elastic-mnist/etcd/rdzv-secret ...

torch's DynamicRendezvousHandler `pickle.loads` whatever the backend returns, so anyone who can write
the state key could run code on every node. The etcd-v3 backend therefore checks the bytes first:

- `check_pickle`: a restricted unpickler admits only the classes that state is made of (mapped onto
  the plain stand-ins below, so nothing of torch runs and no other callable is ever resolved);
- `seal`/`unseal`: with a per-job secret, a value is written as MAGIC + HMAC-SHA256 + value, the MAC
  covering the key name too (a value copied from another job's key does not verify);
- `seal_state`/`unseal_state`: a state is sealed with its `Lineage` as well (LINEAGE_MAGIC + MAC +
  lineage + pickle): where in the key's etcd history it was written, so that an older state written
  back later is refused (_replay.py checks it against etcd's own revisions).

`elastic-mnist status` decodes with the same unpickler (`decode_state`), without importing torch.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import pickle
import struct
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from elastic_mnist.etcd.client import EtcdV3Error

_DYNAMIC = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
MAGIC = b"EMRDZV1\0"  # a pickle (protocol >= 2) starts with 0x80, so sealed and bare states never collide
LINEAGE_MAGIC = b"EMRDZV2\0"  # a state sealed with its Lineage
_TAG_LEN = hashlib.sha256().digest_size
_LINEAGE = struct.Struct(">QQQ")


@dataclass(frozen=True)
class Lineage:
    """Where a sealed state claims to sit in its etcd key's history; covered by the MAC."""

    floor: int
    """A revision the writer saw the key at: the mod revision it replaced, or the read that found it absent."""
    created: int
    """The create_revision of the key it replaced; 0 when this write creates the key."""
    version: int
    """The key's etcd version once this write lands (etcd counts every put since the key's creation)."""


class StateIntegrityError(EtcdV3Error):
    """The state in etcd was not written by this job (tampered, foreign, or sealed with another secret)."""


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


ALLOWED_CLASSES = {  # (module, name) as the pickle names them -> what they decode to
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
            return ALLOWED_CLASSES[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"unexpected class {module}.{name} in rendezvous state") from None


def decode_state(state_bits: bytes) -> RendezvousState:
    """torch's pickled _RendezvousState (bare or sealed; a seal is NOT verified here) -> RendezvousState."""
    if state_bits.startswith(MAGIC):
        state_bits = state_bits[len(MAGIC) + _TAG_LEN:]
    elif state_bits.startswith(LINEAGE_MAGIC):
        state_bits = state_bits[len(LINEAGE_MAGIC) + _TAG_LEN + _LINEAGE.size:]
    state = _StateUnpickler(io.BytesIO(state_bits)).load()
    if not isinstance(state, RendezvousState):
        raise pickle.UnpicklingError(f"rendezvous state is a {type(state).__name__}, not _RendezvousState")
    return state


def check_pickle(key: str, state_bits: bytes) -> None:
    """Raise StateIntegrityError unless the bytes are a _RendezvousState made only of admitted classes.
    Every pickle opcode that could call something resolves its callable through find_class, so a pickle
    that passes here names only those classes, and torch's own unpickler resolves the same ones."""
    try:
        decode_state(state_bits)
    except Exception as exc:  # noqa: BLE001 - any failure to decode means: not our state
        raise StateIntegrityError(
            f"refusing the rendezvous state in {key}: it is not torch's rendezvous state ({exc}); someone "
            "who can write that key wrote it. Nothing of it was executed; stop the writer, delete the key, "
            "and turn on etcd authentication (docs/security.md)") from None


def _tag(secret: bytes, key: str, body: bytes, magic: bytes = MAGIC) -> bytes:
    return hmac.new(secret, magic + key.encode() + b"\0" + body, hashlib.sha256).digest()


def seal(secret: bytes | None, key: str, value: bytes) -> bytes:
    """What is written to etcd: the value itself without a secret, else MAGIC + MAC + value."""
    return value if secret is None else MAGIC + _tag(secret, key, value) + value


def seal_state(secret: bytes | None, key: str, state_bits: bytes, lineage: Lineage) -> bytes:
    """A state as written to etcd: the pickle without a secret, else LINEAGE_MAGIC + MAC + lineage + pickle."""
    if secret is None:
        return state_bits
    body = _LINEAGE.pack(lineage.floor, lineage.created, lineage.version) + state_bits
    return LINEAGE_MAGIC + _tag(secret, key, body, LINEAGE_MAGIC) + body


def unseal(secret: bytes | None, key: str, stored: bytes) -> bytes:
    """The checked pickle inside what etcd holds; StateIntegrityError if it may not reach pickle.loads."""
    return unseal_state(secret, key, stored)[0]


def unseal_state(secret: bytes | None, key: str, stored: bytes) -> tuple[bytes, Lineage | None]:
    """The checked pickle and the lineage it was sealed with (None: sealed without one, or no secret)."""
    body, lineage = open_lineage(secret, key, stored)
    check_pickle(key, body)  # with a secret too, defense in depth: a leaked secret still cannot run code
    return body, lineage


def open_lineage(secret: bytes | None, key: str, stored: bytes) -> tuple[bytes, Lineage | None]:
    """What was sealed into `stored` (HMAC checked) and its lineage (None: sealed without one, or no secret)."""
    body = verified(secret, key, stored)
    if secret is not None and stored.startswith(LINEAGE_MAGIC):
        return body[_LINEAGE.size:], Lineage(*_LINEAGE.unpack_from(body))
    return body, None


def _magic_of(stored: bytes) -> bytes | None:
    return next((m for m in (MAGIC, LINEAGE_MAGIC) if stored.startswith(m)), None)


def is_sealed(stored: bytes) -> bool:
    return _magic_of(stored) is not None


def verified(secret: bytes | None, key: str, stored: bytes) -> bytes:
    """What was sealed into `stored` (its HMAC checked, with a secret); StateIntegrityError if it does not verify."""
    magic = _magic_of(stored)
    if secret is None:
        if magic is not None:
            raise StateIntegrityError(
                f"the rendezvous state in {key} is sealed with a secret but this node has none: give every "
                "node the same secret_file=PATH (or $ELASTIC_MNIST_RDZV_SECRET_FILE)")
        return stored
    tag, body = stored[len(magic or b""):len(magic or b"") + _TAG_LEN], stored[len(magic or b"") + _TAG_LEN:]
    short = magic == LINEAGE_MAGIC and len(body) < _LINEAGE.size
    if magic is None or short or not hmac.compare_digest(tag, _tag(secret, key, body, magic)):
        raise StateIntegrityError(
            f"refusing the rendezvous state in {key}: its HMAC does not verify with this job's secret "
            "(tampered with, written by a node with another secret, or by one without secret_file). "
            "Nothing of it was executed; check that every node has the same secret, then look for who "
            "else writes that key (docs/security.md)")
    return body
