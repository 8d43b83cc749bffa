"""Live progress for `elastic-mnist local`: the trainer's rank-0 lines from whichever node holds
rank 0, warnings from any node, and the launcher's own events, each stamped with seconds since launch.

    elastic-mnist local --nodes 2     # prints what this module follows
"""

from __future__ import annotations

import os
import time

# Lines worth showing live; torchrun's own INFO/WARNING chatter stays in the node logs.
_SHOW = ("[train]", "[eval]", "[resume]", "[start]", "[stop]", "[done]", "[first-step]")
_WARN = ("warning:", "collective failed", "error:")


class LiveView:
    def __init__(self, nodes: dict):
        self.nodes = nodes
        self._offsets: dict[str, int] = {}
        self.t0 = time.time()

    def _stamp(self) -> str:
        return f"{time.time() - self.t0:7.1f}s"

    def event(self, text: str) -> None:
        print(f"{self._stamp()} [local] {text}", flush=True)

    def poll(self) -> None:
        for name, node in list(self.nodes.items()):
            try:
                with open(node.log_path, "rb") as f:
                    f.seek(self._offsets.get(name, 0))
                    chunk = f.read()
            except FileNotFoundError:
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offsets[name] = self._offsets.get(name, 0) + len(complete)
            for line in complete.decode(errors="replace").splitlines():
                if line.startswith(_SHOW) or any(w in line for w in _WARN):
                    print(f"{self._stamp()} [{name}] {line.strip()[:240]}", flush=True)
