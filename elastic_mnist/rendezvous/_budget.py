"""A peer's departure is not this node's failure: a membership change spends none of its restarts, and a
node whose own workers crash too often leaves the job without ending it for the others.

    torchrun --rdzv-backend=etcd-v3 --max-restarts=3 ...   # a peer may leave 1000 times; 4 own crashes end it
    torchrun --rdzv-backend=etcd-v3 --rdzv-conf=crash_limit=10,crash_window=3600 ...

torch's agent (SimpleElasticAgent._invoke_run) takes one from --max-restarts for every worker that exits
non-zero, and restarts a healthy worker group for free when `num_nodes_waiting()` > 0 (a node joining). A
worker whose round ended for a membership change (a peer lost, stopped or joining; a group that did not
form) therefore does not exit: it leaves a note in its agent's directory and waits (agent_link.end_process).
This agent's poll of `num_nodes_waiting` takes the note and reports a waiting node, so torch restarts the
workers as for a join. What torch still counts is this node's own failures.

Those are limited by rate as well: more than `crash_limit` within `crash_window` seconds and this node gives
up. It leaves the rendezvous (the others re-form without it at once) and its agent exits 69 (NODE_LOCAL:
another node may do better). torch's launcher shuts the rendezvous down, which closes it for every node,
whenever its agent ends other than by a signal, also when it gives up; here a node that ends on an error
only leaves it (a configuration error closes it in _verdict.py, a finished job when its workers succeed).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable

from elastic_mnist import agent_link
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.rdzv_conf import BACKEND_NAME
from elastic_mnist.rendezvous.policy import AgentPolicy, Layer, Methods


class RestartBudget:
    """Wraps the three methods torch's agent and launcher call on the handler."""

    def __init__(self, inner: Methods, agent_dir: str, limit: int, window_s: float,
                 leave: Callable[[], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._dir, self._limit, self._window_s, self._leave, self._clock = agent_dir, limit, window_s, leave, clock
        self._next_rendezvous, self._num_nodes_waiting = inner.next_rendezvous, inner.num_nodes_waiting
        self._shutdown = inner.shutdown
        self._joined = False  # a first rendezvous is no restart
        self._free = False  # the coming restart is a membership change (torch did not count it)
        self.crashes: deque[float] = deque()

    def num_nodes_waiting(self) -> int:
        waiting = self._num_nodes_waiting()
        if not waiting and agent_link.take_round_over(self._dir):
            print(f"elastic-mnist {BACKEND_NAME}: this node's workers ended their round for a membership change; "
                  "restarting them into the next round (no restart is counted)", file=sys.stderr, flush=True)
            waiting = 1
        if waiting:
            agent_link.mark_stopping(self._dir, True)  # a worker whose round ends now need not wait for us
        self._free = self._free or waiting > 0
        return waiting

    def next_rendezvous(self):
        if self._joined and not self._free and not (agent_link.config_error(self._dir) or
                                                     agent_link.node_local(self._dir)):
            self._crashed()  # those end the job or this node with their own line (_verdict.py)
        self._joined, self._free = True, False
        agent_link.take_round_over(self._dir)  # a note from a worker stopped before its agent took it
        agent_link.mark_stopping(self._dir, False)
        return self._next_rendezvous()

    def _crashed(self) -> None:
        now = self._clock()
        self.crashes.append(now)
        while self.crashes and self.crashes[0] < now - self._window_s:
            self.crashes.popleft()
        if len(self.crashes) > self._limit:
            print(f"elastic-mnist {BACKEND_NAME}: error: this node's workers failed {len(self.crashes)} times within "
                  f"{self._window_s:.0f}s (crash_limit={self._limit}); this node leaves the job, which goes on "
                  f"without it: fix what fails here (its workers' errors are above), or raise --rdzv-conf "
                  f"crash_limit", file=sys.stderr, flush=True)
            raise SystemExit(exit_codes.NODE_LOCAL)

    def shutdown(self) -> bool:
        """torch's launcher calls this in a `finally` whenever its agent ends other than by a signal, and it
        closes the rendezvous for every node. That is right when the workers succeeded (the job is over);
        when an exception is on its way out (workers that failed past --max-restarts: ChildFailedError; this
        node giving up; a rendezvous error of its own) this node only leaves and the others re-form."""
        if sys.exc_info()[0] is None:
            return self._shutdown()
        self._leave()
        return True


def count_only_own_failures(agent_dir: str, limit: int, window_s: float, leave: Callable[[], None]) -> Layer:
    """The policy's budget layer: all three methods."""
    def layer(inner: Methods, policy: AgentPolicy) -> Methods:
        budget = RestartBudget(inner, agent_dir, limit, window_s, leave)
        return Methods(budget.next_rendezvous, budget.num_nodes_waiting, budget.shutdown)
    return layer
