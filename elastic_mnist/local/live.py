"""Live progress for `elastic-mnist local`: the trainer's rank-0 lines from whichever node holds
rank 0, warnings from any node, and the launcher's own events, each stamped with seconds since launch.

    elastic-mnist local --nodes 2     # prints what this module follows
"""

from __future__ import annotations

import time

from elastic_mnist.runlog import LineTail

# Lines worth showing live; torchrun's own INFO/WARNING chatter stays in the node logs.
_SHOW = ("[train]", "[eval]", "[resume]", "[start]", "[stop]", "[done]", "[first-step]")
_WARN = ("warning:", "collective failed", "error:")


class LiveView:
    def __init__(self, nodes: dict):
        self.nodes = nodes
        self._tails: dict[str, LineTail] = {}
        self.t0 = time.time()

    def _stamp(self) -> str:
        return f"{time.time() - self.t0:7.1f}s"

    def event(self, text: str) -> None:
        print(f"{self._stamp()} [local] {text}", flush=True)

    def poll(self) -> None:
        for name, node in list(self.nodes.items()):
            tail = self._tails.setdefault(name, LineTail(node.log_path))
            for line in tail.read():
                if line.startswith(_SHOW) or any(w in line for w in _WARN):
                    print(f"{self._stamp()} [{name}] {line.strip()[:240]}", flush=True)
