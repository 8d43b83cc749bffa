"""A c10d Store over etcd's v3 API: what the etcd-v3 rendezvous hands to torchrun's agents.

    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 ...   # agents use it for MASTER_ADDR,
                                                                          # rank assignment and exit barriers

Keys live under `{key_prefix}/{run_id}/store/`. Blocking reads wait on an etcd watch (no polling),
re-reading at least every WATCH_RECHECK_S in case a watch was lost (e.g. etcd restarted).
Workers do not use this store: by default torch shares a TCPStore hosted by the rank-0 agent.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError, Store

from elastic_mnist.rendezvous._client import EtcdV3Client, EtcdV3Error
from elastic_mnist.rendezvous._lease import LeaseKeeper

WATCH_RECHECK_S = 2.0


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


class EtcdV3Store(Store):
    """set/get/add/check/wait/compare_set/delete_key/num_keys with c10d's semantics, atomic via etcd txns."""

    def __init__(self, client: EtcdV3Client, prefix: str, timeout: timedelta | None = None,
                 lease: LeaseKeeper | None = None) -> None:
        super().__init__()  # required by the pybind trampoline
        self._client = client
        self._lease = lease or LeaseKeeper(client, 0)
        self.prefix = prefix.rstrip("/") + "/"
        if timeout is not None:
            self.set_timeout(timeout)

    def _key(self, key: str | bytes) -> bytes:
        return self.prefix.encode() + _bytes(key)

    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        k, v = self._key(key), _bytes(value)
        self._lease.run(f"set store key {key!r}", lambda c, lease: c.put(k, v, lease=lease))

    def get(self, key: str) -> bytes:  # type: ignore[override]
        k = self._key(key)
        found = self._wait_for([k], self.timeout)
        if found is None:
            raise DistStoreError(f"EtcdV3Store: timed out after {self.timeout} waiting for key {key!r} "
                                 f"(etcd at {self._client.spec.endpoint})")
        return found[k]

    def add(self, key: str, num: int) -> int:  # type: ignore[override]
        """Atomic increment: a compare on the key's mod_revision; losing a race means re-read and retry."""
        k = self._key(key)
        while (new := self._try_add(k, num)) is None:
            pass  # another writer landed first, so the system made progress: retry at once
        return new

    def _try_add(self, k: bytes, num: int) -> int | None:
        value, meta = self._client.call(f"read store counter {k!r}", lambda c: c.get(k))
        new = num + (int(value) if value is not None else 0)

        def txn(c: Any, lease: int | None) -> tuple[bool, list[Any]]:
            t = c.transactions
            guard = t.create(k) == 0 if meta is None else t.mod(k) == meta.mod_revision
            return c.transaction(compare=[guard], success=[t.put(k, str(new), lease=lease)], failure=[])

        return new if self._lease.run(f"add to store counter {k!r}", txn)[0] else None

    def compare_set(self, key: str, expected_value: str | bytes,  # type: ignore[override]
                    desired_value: str | bytes) -> bytes:
        """c10d semantics: set if the value equals `expected` (or the key is absent and `expected` is
        empty); return the value now stored, or `expected` when the key is absent and was not set."""
        k, expected, desired = self._key(key), _bytes(expected_value), _bytes(desired_value)

        def txn(c: Any, lease: int | None) -> tuple[bool, list[Any]]:
            t = c.transactions
            guard = t.create(k) == 0 if not expected else t.value(k) == expected
            return c.transaction(compare=[guard], success=[t.put(k, desired, lease=lease)], failure=[t.get(k)])

        succeeded, responses = self._lease.run(f"compare_set store key {key!r}", txn)
        if succeeded:
            return desired
        kvs = responses[0]
        return kvs[0][0] if kvs else expected

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        found, _ = self._read([self._key(k) for k in keys])
        return len(found) == len(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        if self._wait_for([self._key(k) for k in keys], timeout or self.timeout) is None:
            raise DistStoreError(f"EtcdV3Store: timed out after {timeout or self.timeout} waiting for keys "
                                 f"{keys} (etcd at {self._client.spec.endpoint})")

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        k = self._key(key)
        return bool(self._client.call(f"delete store key {key!r}", lambda c: c.delete(k)))

    def num_keys(self) -> int:  # type: ignore[override]
        resp = self._client.call("count store keys", lambda c: c.get_prefix_response(self.prefix, count_only=True))
        return int(resp.count)

    # -- blocking reads ------------------------------------------------------------------------
    def _read(self, keys: list[bytes]) -> tuple[dict[bytes, bytes], int]:
        """The keys present now, and a revision no later than any of the reads (where a watch may start)."""
        found: dict[bytes, bytes] = {}
        revision: int | None = None
        for k in keys:
            resp = self._client.call("read the store", lambda c, k=k: c.get_response(k))
            revision = resp.header.revision if revision is None else min(revision, resp.header.revision)
            if resp.kvs:
                found[k] = resp.kvs[0].value
        return found, revision or 0

    def _wait_for(self, keys: list[bytes], timeout: timedelta) -> dict[bytes, bytes] | None:
        deadline = time.monotonic() + timeout.total_seconds()
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
