"""Store values and beacon reports that carry their place in their key's etcd history, so an older sealed
value written back (a replay) is ignored.

    torchrun --rdzv-backend=etcd-v3 --rdzv-conf secret_file=/etc/elastic-mnist/etcd/rdzv-secret ...

The HMAC (_state.seal) proves that a node of this job wrote a value, not that it is the newest one under its
key: whoever can write etcd could save one and put it back later ("A cannot reach B" after the cut healed,
an old counter in the store). So, with a secret, each write is a transaction guarded by the key's mod
revision as read just before it (retried on a lost race), and the value is sealed with the `Lineage` etcd
will record for it, as the rendezvous state is (_replay.py): the revision it replaces, the key's create
revision, its version once written. A value put back by anyone else is a later put, so etcd records
another version for it (or, after a delete, another create revision), and `Order.open` refuses it like
a forged one. What etcd's metadata cannot tell apart, the key deleted and then its very first value
written back, a reader that saw a later value refuses too (the floors of one key's genuine values only
grow), and the beacon's own writer puts its value back (_liveness.py). Without a secret nothing is sealed
or ordered: whoever can write the prefix is trusted (docs/security.md).
"""

from __future__ import annotations

from typing import Any

from elastic_mnist.etcd.client import EtcdV3Client
from elastic_mnist.etcd.lease import LeaseKeeper
from elastic_mnist.etcd.rdzv_state import Lineage, open_lineage, seal_state
from elastic_mnist.rendezvous._replay import StateReplayError

_KEEP = 4096  # keys whose floor a reader remembers (a round writes a handful of store keys)


def read(client: EtcdV3Client, what: str, key: bytes | str) -> tuple[int, Any]:
    """(the revision of the read, the key's KeyValue or None): what a guarded write needs."""
    resp = client.call(what, lambda c: c.get_response(key))
    return int(resp.header.revision), (resp.kvs[0] if resp.kvs else None)


def lineage_after(revision: int, kv: Any) -> Lineage:
    """The lineage of a value written over kv (None: created where the key was absent at `revision`)."""
    if kv is None:
        return Lineage(revision, 0, 1)
    return Lineage(int(kv.mod_revision), int(kv.create_revision), int(kv.version) + 1)


def guard(c: Any, key: bytes | str, kv: Any) -> Any:
    """The compare under which that lineage comes true: nobody wrote the key since it was read."""
    return c.transactions.create(key) == 0 if kv is None else c.transactions.mod(key) == kv.mod_revision


def seal(secret: bytes | None, name: str, value: bytes, revision: int, kv: Any) -> bytes:
    """value as written over kv: plain without a secret, else sealed with its lineage."""
    return value if secret is None else seal_state(secret, name, value, lineage_after(revision, kv))


def _name(key: bytes | str) -> str:
    return key.decode("latin-1") if isinstance(key, bytes) else key  # latin-1: any key bytes, one-to-one


def put(client: EtcdV3Client, lease: LeaseKeeper, what: str, pairs: list[tuple[bytes | str, bytes]],
        secret: bytes | None) -> list[bytes]:
    """Write every (key, value) in one transaction, each sealed with its lineage; the bytes written. A
    concurrent writer makes the guard fail: read again and retry at once (the other made progress)."""
    while True:
        reads = [read(client, what, k) if secret is not None else (0, None) for k, _ in pairs]
        sealed = [seal(secret, _name(k), v, rev, kv) for (k, v), (rev, kv) in zip(pairs, reads)]

        def txn(c: Any, lease_id: int | None) -> tuple[bool, list[Any]]:
            compare = [guard(c, k, kv) for (k, _), (_, kv) in zip(pairs, reads)] if secret is not None else []
            return c.transaction(compare=compare, failure=[],
                                 success=[c.transactions.put(k, s, lease=lease_id) for (k, _), s in zip(pairs, sealed)])

        if lease.run(what, txn)[0]:
            return sealed


class Order:
    """One reader's check of ordered values: the lineage must be what etcd records, and never older than a
    value this reader already admitted under the same key."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, int]] = {}  # key -> (highest floor admitted, newest mod revision)

    def open(self, secret: bytes | None, key: bytes | str, stored: bytes, kv: Any) -> bytes:
        """The value sealed in `stored` (as etcd holds it: kv); StateIntegrityError if it does not verify,
        StateReplayError if it is an older value of this job written back."""
        name = _name(key)
        value, lineage = open_lineage(secret, name, stored)
        if secret is None:
            return value
        if lineage is None:  # the messages leave the key to the caller, which names it
            raise StateReplayError("it is sealed without its place in the key's history (written by an older "
                                   "elastic-mnist?); run one version on every node")
        mod, seen = int(kv.mod_revision), self._seen.get(name, (0, 0))
        floor, newest = seen if mod >= seen[1] else (0, 0)  # etcd lost its data: nothing seen compares
        claimed = (mod if lineage.created == 0 else lineage.created, lineage.version)
        if claimed != (int(kv.create_revision), int(kv.version)) or lineage.floor >= mod:
            raise StateReplayError(f"it was sealed as version {lineage.version} of the key and etcd holds it as "
                                   f"version {kv.version}: an older value of this job written back (a replay)")
        if lineage.floor < floor:
            raise StateReplayError(f"it is older than a value already seen there (it replaced revision "
                                   f"{lineage.floor}, a newer one {floor}): written back after a delete (a replay)")
        self._seen[name] = (lineage.floor, max(newest, mod))
        while len(self._seen) > _KEEP:
            self._seen.pop(next(iter(self._seen)))  # the oldest key first (dicts keep insertion order)
        return value
