"""A configuration error that a worker finds ends the job on every node, once, with its line and exit 78.

    torchrun --rdzv-backend=etcd-v3 ... -m elastic_mnist.train --global-batch-size 100000   # every agent: exit 78

torchrun treats a worker that exits non-zero as a failure to retry: a flag the worker refuses would fail the
same way up to --max-restarts times on every node. Here the worker also hands its one-line reason to its
agent (agent_link.py). Before that agent joins the next round it publishes the reason in the job's store
and closes the rendezvous. Every other agent sees the closed state at its next poll of `num_nodes_waiting`,
stops its workers as for a new round (they save), and ends too; so does any agent started later
(_closed.py reads the same key). The line each prints is the worker's.

A problem of one node only (its own checkpoint dir: the worker exits 69, exit_codes.NODE_LOCAL) ends that node
alone: its agent leaves the rendezvous and exits 69 with the worker's line, the rendezvous stays open and the
other nodes form the next round without it (policy.py's end_this_node).
"""

from __future__ import annotations

import sys
from dataclasses import replace

from torch.distributed import Store

from elastic_mnist import agent_link
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.keys import CONFIG_ERROR_KEY
from elastic_mnist.contract.rdzv_conf import BACKEND_NAME
from elastic_mnist.rendezvous._closed import exit_if_closed
from elastic_mnist.rendezvous._prompt import RoundView
from elastic_mnist.rendezvous.policy import AgentPolicy, Layer, Methods

ALONE = "this node ends, the job goes on without it"  # after the line of a problem of this node only


class Verdict:
    def __init__(self, inner: Methods, policy: AgentPolicy, view: RoundView, store: Store, run_id: str,
                 agent_dir: str, read_state) -> None:
        self._policy, self._view, self._store, self._run_id = policy, view, store, run_id
        self._dir, self._read_state = agent_dir, read_state
        self._next_rendezvous, self._num_nodes_waiting = inner.next_rendezvous, inner.num_nodes_waiting

    def next_rendezvous(self):
        alone = agent_link.node_local(self._dir) if self._dir else None
        if alone:
            self._policy.end_this_node(f"elastic-mnist {BACKEND_NAME}: error: {alone}", exit_codes.NODE_LOCAL, ALONE)
        line = agent_link.config_error(self._dir) if self._dir else None
        if line:
            self._store.set(CONFIG_ERROR_KEY, line)
            self._policy.close()
        if line or self._view.closed:
            exit_if_closed(self._run_id, self._read_state(), self._store, f"elastic-mnist {BACKEND_NAME}")
        return self._next_rendezvous()

    def num_nodes_waiting(self) -> int:
        waiting = self._num_nodes_waiting()
        if self._view.closed and not waiting:
            print(f"elastic-mnist {BACKEND_NAME}: the job's rendezvous was closed by another node; stopping this "
                  "node's workers", file=sys.stderr, flush=True)
            return 1  # torch's agent stops its workers, then next_rendezvous ends this agent with the line
        return waiting


def end_the_job_on_config_errors(view: RoundView, store: Store, run_id: str, agent_dir: str, read_state) -> Layer:
    """The policy's verdict layer: next_rendezvous and num_nodes_waiting."""
    def layer(inner: Methods, policy: AgentPolicy) -> Methods:
        verdict = Verdict(inner, policy, view, store, run_id, agent_dir, read_state)
        return replace(inner, next_rendezvous=verdict.next_rendezvous, num_nodes_waiting=verdict.num_nodes_waiting)
    return layer
