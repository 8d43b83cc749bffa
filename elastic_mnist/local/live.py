"""Live progress for `elastic-mnist local`: the workers' journal records (rank 0's progress, any rank's
warnings and failures) and the launcher's own events, each stamped with seconds since launch.

    elastic-mnist local --nodes 2     # prints what this module follows

What is shown is chosen by each record's kind, never by parsing the printed text; torchrun's own
INFO/WARNING chatter stays in the node logs.
"""

from __future__ import annotations

import os
import time

STUCK_S = 60.0  # a change not recovered after this long is reported, with where its rendezvous stands

# Record kinds worth showing live: from rank 0 (one line per step of the job, not per rank), and from any
# rank (a warning or a failure is news wherever it happens).
_RANK0 = {"progress", "eval", "resume", "start", "stop", "done", "startup", "sync"}
_ANY_RANK = {"warning", "collective_failed"}


class LiveView:
    def __init__(self):
        self.t0 = time.time()

    def _stamp(self) -> str:
        return f"{time.time() - self.t0:7.1f}s"

    def event(self, text: str) -> None:
        print(f"{self._stamp()} [local] {text}", flush=True)

    def show(self, records: list[dict]) -> None:
        """New journal records, in the order they were written."""
        for r in sorted(records, key=lambda r: r["time"]):
            kind = r.get("event")
            if (kind in _ANY_RANK or (kind in _RANK0 and r.get("rank") == 0)) and r.get("message"):
                where = r.get("node") or f"rank {r.get('rank')}"
                print(f"{self._stamp()} [{where}] {r['message'][:240]}", flush=True)


def stuck_line(kind: str, node: str | None, waited: float, world: int, status: dict | None,
               names: dict[int, str], log: str | None) -> str:
    """One line for a change the job has not recovered from: who is in the round etcd holds, who waits
    (a joiner in neither never reached the rendezvous), and the node's own last log line. `names` maps an
    agent's pid (in torch's node id, host_pid_local) to the launcher's name for it."""
    def name(desc: str) -> str:
        parts = desc.rsplit("_", 2)
        return names.get(int(parts[1]), desc) if len(parts) == 3 and parts[1].isdigit() else desc

    where = "rendezvous state not readable (--hosts, or not etcd-v3)"
    if status and status.get("found"):
        members = ",".join(name(p["node"]) for p in status["participants"])
        where = (f"rendezvous round {status['round']} {status['phase']}: members [{members}], "
                 f"waiting [{','.join(map(name, status['waiting']))}]")
    last = _last_line(log) if log else None
    tail = f"; {node}'s last log line: {last}" if last else ""
    return f"{kind} {node or ''} not recovered after {waited:.0f}s (world {world}); {where}{tail}"


def read_rendezvous(endpoint: str, run_id: str, conf_items) -> dict | None:
    """The job's rendezvous as etcd-v3 holds it (`elastic-mnist status` reads the same); None if unreadable."""
    from elastic_mnist.etcd.rdzv_status import read_rendezvous_status  # etcd's client: only when asked

    conf = dict(conf_items)
    try:
        return read_rendezvous_status(endpoint, run_id, key_prefix=conf.pop("key_prefix", None), **conf)
    except Exception:  # noqa: BLE001 - the node logs still hold what happened
        return None


def _last_line(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[-1][:300] if lines else None
