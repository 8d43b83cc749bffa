"""The lease every key of one agent process is written with, so a crashed job's keys expire.

    torchrun --rdzv-backend=etcd-v3 --rdzv-conf lease_ttl=7200 ...   # 0 = keys never expire

Why a lease at all: without one, the state and store keys of every job that ever ran stay in etcd
forever. Why per process and refreshed on write: a put re-attaches the key to the writer's lease, and
every live agent rewrites the state at least every keep_alive_interval, so the state key always
carries the lease of a live writer. Keys disappear only after lease_ttl of silence from the whole job.
Why 2 h by default: the same TTL torch's etcd-v2 backend puts on its state; it must cover any etcd
outage a job should survive (etcd itself re-grants every lease its full TTL when it restarts), and it
leaves a finished job's state readable by `elastic-mnist status` for a while.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import etcd3

from elastic_mnist.etcd.client import EtcdV3Client, EtcdV3Error

T = TypeVar("T")


class LeaseKeeper:
    """Grants one lease lazily, refreshes it at most every ttl/4 while in use, re-grants if it expired."""

    def __init__(self, client: EtcdV3Client, ttl: int) -> None:
        self._client, self.ttl = client, int(ttl)
        self._lock = threading.Lock()
        self._id: int | None = None
        self._refreshed = 0.0

    def current(self) -> int | None:
        """The lease id to attach to a put; None when leases are off (ttl 0)."""
        if self.ttl <= 0:
            return None
        with self._lock:
            now = time.monotonic()
            if self._id is not None and now - self._refreshed >= self.ttl / 4 and not self._refresh(self._id):
                self._id = None  # expired while we were silent (frozen process, long etcd outage)
            if self._id is None:
                self._id = self._client.call("grant a lease", lambda c: int(c.lease(self.ttl).id))
                self._refreshed = now
            return self._id

    def _refresh(self, lease_id: int) -> bool:
        responses = self._client.call("refresh a lease", lambda c: list(c.refresh_lease(lease_id)))
        self._refreshed = time.monotonic()
        return bool(responses) and responses[0].TTL > 0

    def run(self, what: str, fn: Callable[[etcd3.MultiEndpointEtcd3Client, int | None], T]) -> T:
        """fn(client, lease_id) inside client.call; re-grants once if etcd no longer knows the lease."""
        for attempt in (1, 2):
            lease_id = self.current()
            try:
                return self._client.call(what, lambda c, lease_id=lease_id: fn(c, lease_id))
            except EtcdV3Error as exc:
                if attempt == 2 or "lease not found" not in str(exc):
                    raise
                with self._lock:
                    if self._id == lease_id:
                        self._id = None
        raise AssertionError("unreachable")
