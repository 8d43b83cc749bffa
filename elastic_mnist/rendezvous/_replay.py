"""Refusing an older sealed state written back into the state key (a replay), from etcd's own revisions.

    torchrun --rdzv-backend=etcd-v3 --rdzv-conf secret_file=/etc/elastic-mnist/etcd/rdzv-secret ...

The HMAC (etcd/rdzv_state.py) proves a node of this job wrote a state, not that it is the state written last:
whoever can write etcd could save one and put it back after the job moved on. So each sealed state
carries its `Lineage`, predicted by its writer from what torch's compare-and-set guarantees: the write
lands only if the key still has the mod revision the writer read (the fencing token), so the new value
has that key's create_revision and its version + 1 (etcd counts every put), or, for the write that
creates the key, create_revision == mod_revision and version 1. A value written back by anyone else
is a later put, so etcd gives it another version (or, after deleting the key, another create_revision)
than its seal claims. What etcd's metadata cannot tell apart (the key deleted, then its very first
state written back) each node still refuses once it has seen a later state: every genuine write's
floor (the revision it replaced) grows, so a floor below one already admitted is older.

etcd's revisions never go back unless etcd lost its data (restored from a backup, a wiped member):
then nothing seen before can be compared, and the guard starts over.
"""

from __future__ import annotations

from typing import Any

from elastic_mnist.etcd.rdzv_state import Lineage, StateIntegrityError

_KEEP = 8  # tokens whose metadata we remember: torch writes with the token it read last


class StateReplayError(StateIntegrityError):
    """A state sealed by this job, but not where etcd holds it: an older state written back."""


class ReplayGuard:
    """Per backend: predicts each write's Lineage and admits only states whose lineage matches etcd's."""

    def __init__(self) -> None:
        self._floor = 0  # the highest floor admitted
        self._newest = 0  # the highest mod revision admitted
        self._known: dict[int, tuple[int, int]] = {}  # mod revision -> (create_revision, version)
        self._absent_at = 0  # the revision at which this node last found the key absent

    def found_absent(self, revision: int) -> None:
        self._absent_at = max(self._absent_at, revision)

    def successor(self, token: int | None) -> Lineage:
        """The lineage of a state written over `token` (None: created where the key was absent)."""
        if not token:  # the key is absent now, so this write comes after every revision seen so far
            return Lineage(max(self._absent_at, self._newest), 0, 1)
        created, version = self._known.get(token, (0, 0))  # a token never read cannot match: the txn fails
        return Lineage(token, created, version + 1)

    def admit(self, key: str, lineage: Lineage | None, meta: Any) -> None:
        """Raise StateReplayError unless `lineage` (from the seal) fits meta (etcd's KV metadata)."""
        mod, created, version = int(meta.mod_revision), int(meta.create_revision), int(meta.version)
        if lineage is None:
            raise StateReplayError(f"refusing the rendezvous state in {key}: it is sealed without its place in "
                                   "the key's history (written by an older elastic-mnist?); run one version on "
                                   "every node")
        if mod < self._newest:  # etcd lost its data: what we saw before is not comparable
            self._floor, self._known = 0, {}
        claimed = (mod if lineage.created == 0 else lineage.created, lineage.version)
        if claimed != (created, version) or lineage.floor >= mod:
            raise StateReplayError(
                f"refusing the rendezvous state in {key}: it was sealed as version {lineage.version} of the key "
                f"(created at revision {claimed[0]}) but etcd holds it as version {version} (created at revision "
                f"{created}): an older state of this job written back (a replay) by someone who can write that "
                "key. Nothing of it was used; look for who else writes it (docs/security.md)")
        if lineage.floor < self._floor:
            raise StateReplayError(
                f"refusing the rendezvous state in {key}: it is older than a state this node already saw "
                f"(it replaced revision {lineage.floor}, a newer one replaced {self._floor}): written back (a "
                "replay) after the key was deleted. Nothing of it was used; look for who else writes it "
                "(docs/security.md)")
        self._floor, self._newest = lineage.floor, max(self._newest, mod)
        self._known[mod] = (created, version)
        while len(self._known) > _KEEP:
            self._known.pop(min(self._known))
