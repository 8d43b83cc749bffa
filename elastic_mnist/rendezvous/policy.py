"""torch's rendezvous handler reshaped in one place, in one explicit order.

    torchrun --rdzv-backend=etcd-v3 ...    # create_rdzv_handler builds one AgentPolicy over torch's handler

torch's agent and launcher call three methods of the handler: `next_rendezvous` (join a round),
`num_nodes_waiting` (its monitor's poll: restart the workers for a new round?) and `shutdown` (the agent
ends). Each layer below wraps some of them and sees the methods of the layers before it, innermost first:

    shrink   a member missing from the round written in etcd restarts the workers at once    (_shrink.py)
    sweep    the new round's rank 0 deletes what finished rounds left in etcd                 (_sweep.py)
    verdict  a worker's configuration error ends the job; a node-local one this node only   (_verdict.py)
    flags    this agent's flags are the job's, written again before each join                (_flags.py)
    budget   only this node's own failures spend its restarts; giving up leaves, never closes (_budget.py)

Apart from compat/, this is the only place that assigns to an attribute of a torch object
(tests/test_layout.py checks it): the order is the one written here, whatever calls `add`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

ORDER = ("shrink", "sweep", "verdict", "flags", "budget")


@dataclass(frozen=True)
class Methods:
    """The handler's three methods as the layers so far made them."""

    next_rendezvous: Callable
    num_nodes_waiting: Callable[[], int]
    shutdown: Callable[[], bool]


Layer = Callable[["Methods", "AgentPolicy"], "Methods"]


class AgentPolicy:
    def __init__(self, handler) -> None:
        self._handler, self._ended = handler, False
        self.methods = Methods(handler.next_rendezvous, handler.num_nodes_waiting, handler.shutdown)
        self.layers: list[str] = []

    def add(self, name: str, layer: Layer) -> AgentPolicy:
        """Wrap the methods so far in `layer`; layers come in ORDER (one may be left out)."""
        if name not in ORDER or (self.layers and ORDER.index(name) <= ORDER.index(self.layers[-1])):
            raise ValueError(f"layer {name!r} after {self.layers}: the order is {ORDER}")
        self.methods = layer(self.methods, self)
        self.layers.append(name)
        return self

    def install(self) -> None:
        """The handler's methods become the layers' (an instance's own attributes win over its class's)."""
        handler = self._handler
        handler.next_rendezvous = self.methods.next_rendezvous
        handler.num_nodes_waiting = self.methods.num_nodes_waiting
        handler.shutdown = self._shutdown

    def close(self) -> None:
        """Close the rendezvous for every node (a configuration error ends the job)."""
        self._handler.set_closed()

    def end_this_node(self, line: str, code: int, why: str) -> NoReturn:
        """End this agent with `line` and `code`, the job going on: torch's launcher shuts the rendezvous down
        (closes it, for every node) when its agent ends by anything but a signal, so shutdown does nothing from
        here on. The node leaves the rendezvous at the process's exit (_leave.py), as a preempted one does."""
        self._ended = True
        print(f"{line}; {why}", file=sys.stderr, flush=True)
        raise SystemExit(code)

    def _shutdown(self) -> bool:
        return True if self._ended else self.methods.shutdown()
