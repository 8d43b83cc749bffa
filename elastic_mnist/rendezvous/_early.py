"""What an etcd-v3 agent does before it joins the job's rendezvous: check its workers' flags, and their
fingerprint against the job's (_flags.py), then start its warm process (and, joining a running job, wait for
its workers to build). Everything that ends this node here ends it alone: it never joined, so no round changes
and nothing is closed.

    torchrun --rdzv-backend=etcd-v3 ... -m elastic_mnist.train ...   # create_rdzv_handler calls before_joining
"""

from __future__ import annotations

import os
import sys

from torch.distributed import Store

from elastic_mnist import agent_link
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.rdzv_conf import BACKEND_NAME
from elastic_mnist.rendezvous import _flags as job_flags
from elastic_mnist.rendezvous import _plan as warm_plan
from elastic_mnist.rendezvous import _warm_start as warm_agent
from elastic_mnist.rendezvous._settings import EtcdV3Settings
from elastic_mnist.rendezvous._verdict import ALONE


def before_joining(agent_dir: str, settings: EtcdV3Settings, joining: bool, store: Store,
                   run_id: str) -> dict | None:
    """Before this node joins: its workers' flags are checked (a bad one ends this agent now, with the worker's
    line, exit 78), and so is their fingerprint against the job's (flags that differ from the job's end this
    agent alone, exit 78: _flags.py), and with warm starts its warm process starts. Joining a running job it
    imports torch and, with in-place rounds, builds each worker before it joins, so the job trains on meanwhile;
    a job (re)starting from no node does both while its round forms. Returns the fingerprint it checked (None:
    not this package's worker)."""
    plan = warm_plan.from_torchrun()
    line = warm_plan.check_flags(plan)
    if line:
        agent_link.report_config_error(line)
        print(f"elastic-mnist {BACKEND_NAME}: {line}", file=sys.stderr, flush=True)
        raise SystemExit(exit_codes.PERMANENT)
    mine = job_flags.of_plan(plan)
    line = job_flags.refusal(store, mine, run_id) if mine is not None else ""
    if line:
        print(f"elastic-mnist {BACKEND_NAME}: error: {line}", file=sys.stderr, flush=True)
        raise SystemExit(exit_codes.PERMANENT)
    if settings.warm_start:
        warm_agent.start_for_workers(agent_dir, os.environ, settings.in_place, plan, wait_ready=joining)
        # A worker built early found a configuration error, or a problem of this node only (not joined: the job
        # never saw this node, nothing to close or leave).
        for found, code, alone in ((agent_link.node_local, exit_codes.NODE_LOCAL, f"; {ALONE}"),
                                   (agent_link.config_error, exit_codes.PERMANENT, "")):
            line = found(agent_dir)
            if line:
                print(f"elastic-mnist {BACKEND_NAME}: error: {line}{alone}", file=sys.stderr, flush=True)
                raise SystemExit(code)
    return mine
