"""Live progress for `elastic-mnist local`: the workers' journal records (rank 0's progress, any rank's
warnings and failures) and the launcher's own events, each stamped with seconds since launch.

    elastic-mnist local --nodes 2     # prints what this module follows

What is shown is chosen by each record's kind, never by parsing the printed text; torchrun's own
INFO/WARNING chatter stays in the node logs.
"""

from __future__ import annotations

import time

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
