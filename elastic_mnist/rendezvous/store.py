"""A c10d Store over etcd's v3 API: what the etcd-v3 rendezvous hands to torchrun's agents.

    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 ...   # agents use it for MASTER_ADDR,
                                                                          # rank assignment and exit barriers

Keys live under `{key_prefix}/{run_id}/store/`. Blocking reads wait on an etcd watch (no polling),
re-reading at least every WATCH_RECHECK_S in case a watch was lost (e.g. etcd restarted).
Workers do not use this store: by default torch shares a TCPStore hosted by the rank-0 agent.

torch's C++ layer (the PrefixStore torchrun's agent hands around) reaches a Python Store through a
pybind trampoline that looks up methods by their C++ names for some calls (`getNumKeys`, `deleteKey`)
and by their Python names for others (`compare_set`, `multi_get`, `multi_set`, `append`,
`has_extended_api`, `clone`), so both spellings exist here (the C++ ones added by compat/private.py).
Read-modify-write operations (add, append, compare_set) are one etcd transaction guarded by the key's
mod_revision, retried on a lost race.

With the job's secret (`secret_file`), every value is sealed like the rendezvous state: an HMAC over
the etcd key and the value, with its place in the key's etcd history (_ordered.py), so a value cannot be
forged, moved to another key, or an older one written back. A value that does not verify is treated
as absent (one warning names the key): a reader keeps waiting and gets the genuine value once a node
of the job writes it, and a read-modify-write replaces it.
Raising instead would let a value planted before the genuine one stop the agent. Without a secret,
values are plain and the store trusts everyone who can write the prefix (docs/security.md).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError, Store

from elastic_mnist.compat.private import with_cpp_store_names
from elastic_mnist.etcd.client import EtcdV3Client, EtcdV3Error
from elastic_mnist.etcd.lease import LeaseKeeper
from elastic_mnist.etcd.rdzv_state import StateIntegrityError
from elastic_mnist.rendezvous import _ordered
from elastic_mnist.rendezvous._replay import StateReplayError

WATCH_RECHECK_S = 2.0


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


@with_cpp_store_names  # getNumKeys, deleteKey: the C++ names some calls arrive by
class EtcdV3Store(Store):
    """A complete c10d Store (set/get/add/check/wait/compare_set/delete_key/num_keys, the extended API
    append/multi_get/multi_set, and clone), atomic via etcd transactions."""

    def __init__(self, client: EtcdV3Client, prefix: str, timeout: timedelta | None = None,
                 lease: LeaseKeeper | None = None, secret: bytes | None = None) -> None:
        super().__init__()  # required by the pybind trampoline
        self._client, self._secret = client, secret
        self._refused: set[bytes] = set()  # keys already warned about
        self._order = _ordered.Order()
        self._lease = lease or LeaseKeeper(client, 0)
        self.prefix = prefix.rstrip("/") + "/"
        # Clones handed to C++ (PrefixStore.clone) are referenced only there, and the trampoline does not
        # keep a Python object alive: without this list a clone's methods vanish at the next GC.
        self._clones: list[EtcdV3Store] = []
        if timeout is not None:
            self.set_timeout(timeout)

    def _key(self, key: str | bytes) -> bytes:
        return self.prefix.encode() + _bytes(key)

    def clone(self) -> EtcdV3Store:
        """A store over the same keys, etcd connection and lease (both thread-safe), with its own timeout."""
        twin = EtcdV3Store(self._client, self.prefix, self.timeout, self._lease, self._secret)
        self._clones.append(twin)
        return twin

    # -- sealing ------------------------------------------------------------------------------
    def _open(self, k: bytes, kv: Any) -> bytes | None:
        """The value a node of this job wrote under k, or None (absent, forged, or an older one put back)."""
        if kv is None or self._secret is None:
            return None if kv is None else kv.value  # without a secret, values are plain
        try:
            return self._order.open(self._secret, k, kv.value, kv)
        except StateIntegrityError as exc:
            why = str(exc) if isinstance(exc, StateReplayError) else \
                "its HMAC does not verify with this job's secret (someone without it wrote it)"
            if k not in self._refused:
                self._refused.add(k)
                print(f"elastic-mnist etcd-v3: warning: ignoring the store value under {k.decode('latin-1')}: {why}; "
                      "waiting for the genuine value", file=sys.stderr, flush=True)
            return None

    # -- writes ---------------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        _ordered.put(self._client, self._lease, f"set store key {key!r}", [(self._key(key), _bytes(value))],
                     self._secret)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:  # type: ignore[override]
        """All keys in one transaction: readers never see half of them."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        pairs = [(self._key(k), _bytes(v)) for k, v in zip(keys, values)]
        _ordered.put(self._client, self._lease, f"set store keys {keys}", pairs, self._secret)  # type: ignore[arg-type]

    def add(self, key: str, num: int) -> int:  # type: ignore[override]
        """Atomic increment; a missing key counts as 0."""
        new = self._update(key, lambda old: str(int(old or b"0") + num).encode())
        return int(new)  # type: ignore[arg-type]

    def append(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        """Atomic append; a missing key is created with `value`."""
        tail = _bytes(value)
        self._update(key, lambda old: (old or b"") + tail)

    def compare_set(self, key: str, expected_value: str | bytes,  # type: ignore[override]
                    desired_value: str | bytes) -> bytes:
        """c10d semantics: set if the value equals `expected` (or the key is absent and `expected` is
        empty); return the value now stored, or `expected` when the key is absent and was not set."""
        expected, desired = _bytes(expected_value), _bytes(desired_value)
        seen: list[bytes | None] = []

        def decide(old: bytes | None) -> bytes | None:
            seen.append(old)
            return desired if old == expected or (old is None and not expected) else None

        written = self._update(key, decide)
        if written is not None:
            return written
        return expected if seen[-1] is None else seen[-1]  # type: ignore[return-value]

    def _update(self, key: str, change: Callable[[bytes | None], bytes | None]) -> bytes | None:
        """Read the key, write change(old) unless it is None, only if nobody wrote in between; a lost
        race means another writer made progress, so re-read and retry at once. Returns what was written."""
        k = self._key(key)
        while True:
            revision, kv = _ordered.read(self._client, f"read store key {key!r}", k)
            new = change(self._open(k, kv))  # a value that does not verify counts as absent
            if new is None:
                return None
            sealed = _ordered.seal(self._secret, k.decode("latin-1"), new, revision, kv)

            def txn(c: Any, lease: int | None, sealed: bytes = sealed, kv: Any = kv) -> tuple[bool, list[Any]]:
                return c.transaction(compare=[_ordered.guard(c, k, kv)],
                                     success=[c.transactions.put(k, sealed, lease=lease)], failure=[])

            if self._lease.run(f"update store key {key!r}", txn)[0]:
                return new

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        k = self._key(key)
        return bool(self._client.call(f"delete store key {key!r}", lambda c: c.delete(k)))

    def delete_under(self, prefix: str) -> None:
        """Every key that starts with `prefix` (a finished round's: _sweep.py)."""
        k = self._key(prefix)
        self._client.call(f"delete store keys under {prefix!r}", lambda c: c.delete_prefix(k))

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:  # type: ignore[override]
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:  # type: ignore[override]
        """Blocks until every key exists (as get does), up to the store's timeout."""
        wanted = [self._key(k) for k in keys]
        found = self._wait_for(wanted, self.timeout)
        if found is None:
            raise self._timeout_error(keys, self.timeout)
        return [found[k] for k in wanted]

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        found, _ = self._read([self._key(k) for k in keys])
        return len(found) == len(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        timeout = self.timeout if timeout is None else timeout
        if self._wait_for([self._key(k) for k in keys], timeout) is None:
            raise self._timeout_error(keys, timeout)

    def num_keys(self) -> int:  # type: ignore[override]
        resp = self._client.call("count store keys", lambda c: c.get_prefix_response(self.prefix, count_only=True))
        return int(resp.count)

    def has_extended_api(self) -> bool:  # type: ignore[override]
        return True  # append, multi_get and multi_set are native here, not torch's fallbacks

    def _timeout_error(self, keys: list[str], timeout: timedelta) -> DistStoreError:
        """Worded like torch's own stores ("Timeout waiting for key"), the type TCPStore raises."""
        ms = int(timeout.total_seconds() * 1000)
        return DistStoreError(f"Timeout waiting for key(s) {keys} after {ms} ms in the etcd-v3 store "
                              f"{self.prefix!r} (etcd at {self._client.spec.endpoint}): no peer has set them; "
                              "check that every node of the job is running")

    # -- blocking reads ------------------------------------------------------------------------
    def _read(self, keys: list[bytes]) -> tuple[dict[bytes, bytes], int]:
        """The keys present now, and a revision no later than any of the reads (where a watch may start)."""
        found: dict[bytes, bytes] = {}
        revision: int | None = None
        for k in keys:
            resp = self._client.call("read the store", lambda c, k=k: c.get_response(k))
            revision = resp.header.revision if revision is None else min(revision, resp.header.revision)
            value = self._open(k, resp.kvs[0] if resp.kvs else None)
            if value is not None:
                found[k] = value
        return found, revision or 0

    def _wait_for(self, keys: list[bytes], timeout: timedelta) -> dict[bytes, bytes] | None:
        # A zero timeout is c10d's kNoTimeout: wait until the keys appear.
        deadline = time.monotonic() + timeout.total_seconds() if timeout else float("inf")
        while True:
            found, revision = self._read(keys)
            if len(found) == len(keys):
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._await_change(revision, min(remaining, WATCH_RECHECK_S))

    def _await_change(self, revision: int, seconds: float) -> None:
        """Block until anything under our prefix changes after `revision`, or `seconds` pass."""
        try:
            self._client.wait_for_change(self.prefix, revision, seconds, prefix=True)
        except EtcdV3Error:
            time.sleep(seconds)  # cannot even connect: wait out this slice; the next read reports it
