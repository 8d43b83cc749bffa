"""Every node of a job trains with one configuration: a node whose training flags differ from the job's is
refused before it joins, with one line naming the flags that differ, and exit 78; the job goes on.

    torchrun --rdzv-backend=etcd-v3 --rdzv-id=job1 ... -m elastic_mnist.train --lr 0.5   # job1 trains at 0.001:
    elastic-mnist etcd-v3: error: this node's flags differ from those job job1 trains with: --lr 0.5 (the job: 0.001)...

Two nodes with a different --lr, --seed or --hidden formed one round and trained silently on mixed plans. The
flags that matter are the fingerprint every checkpoint holds (config.FINGERPRINT_FIELDS: what makes two states
incompatible) and --parallel (config.JOB_FIELDS: one round's ranks must run the same collectives). Before its
agent joins, each node compares its own, resolved from its worker's command line, with
the job's: the first node's, written once under FINGERPRINT_KEY in the job's store (an atomic compare-and-set:
of nodes that start together, exactly one defines it). Nothing has joined yet, so the refused node changes no
round and closes nothing; it ends alone (a configuration error of its own command). A rendezvous id keeps its
configuration while its keys live: the key carries the lease of its last writer (etcd/lease.py), and every agent of
the job writes it again at each of its rendezvous (keep_the_job_flags), so it lives while the job does and
expires with it. Another configuration is another job, with a new --rdzv-id.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

from torch.distributed import Store

from elastic_mnist.config import flag_name, parse_args, with_former_fields
from elastic_mnist.contract.errors import UserError
from elastic_mnist.contract.keys import FINGERPRINT_KEY
from elastic_mnist.contract.warm import TRAIN_MODULE, WorkerPlan
from elastic_mnist.rendezvous.policy import AgentPolicy, Layer, Methods

log = logging.getLogger(__name__)


def of_plan(plan: WorkerPlan | None) -> dict | None:
    """The fingerprint flags of the worker this agent will start, resolved as it resolves them (defaults
    included); None for a worker that is not this package's, or flags it refuses (it says so itself)."""
    if plan is None or plan.target.get("module") != TRAIN_MODULE:
        return None
    try:
        return parse_args(plan.args).job_fingerprint()
    except UserError:
        return None


def differing(mine: dict, job: dict) -> list[str]:
    """`--flag mine (the job: theirs)` for every fingerprint flag whose values differ, in name order. A flag
    newer than the job's fingerprint counts as its value from before it (config.with_former_fields)."""
    job = {k: v for k, v in with_former_fields(job).items() if k in mine or k in job}
    return [f"{flag_name(name)} {_shown(mine, name)} (the job: {_shown(job, name)})"
            for name in sorted(set(mine) | set(job)) if mine.get(name) != job.get(name)]


def _shown(flags: dict, name: str) -> str:
    return str(flags[name]) if name in flags else "not set"


def refusal(store: Store, mine: dict, run_id: str) -> str:
    """"" when this node's fingerprint is the job's (or now defines it), else the one line refusing it."""
    ours = json.dumps(mine, sort_keys=True)
    current = store.compare_set(FINGERPRINT_KEY, "", ours).decode(errors="replace")  # set only where absent
    job = _parsed(current)
    if current == ours or (job is not None and not differing(mine, job)):
        return ""
    if job is None:
        return (f"the job's configuration under {FINGERPRINT_KEY} in rendezvous {run_id}'s store is not one this "
                "runtime wrote; start a new job with a new --rdzv-id")
    return (f"this node's flags differ from those job {run_id} trains with: {'; '.join(differing(mine, job))}; "
            "start this node with the job's flags, or another configuration as a new job with a new --rdzv-id "
            "(the job goes on without this node)")


def _parsed(text: str) -> dict | None:
    try:
        job = json.loads(text)
    except ValueError:
        return None
    return job if isinstance(job, dict) else None


def keep_the_job_flags(store: Store, mine: dict) -> Layer:
    """The policy's flags layer: before each rendezvous of this agent (its fingerprint is the job's), write the
    job's key again: a put attaches the key to this live agent's lease, so the key outlives the node that first
    wrote it."""
    ours = json.dumps(mine, sort_keys=True)

    def layer(inner: Methods, policy: AgentPolicy) -> Methods:
        def next_rendezvous():
            try:
                current = store.compare_set(FINGERPRINT_KEY, "", ours).decode(errors="replace")
                job = _parsed(current)
                if current == ours or (job is not None and not differing(mine, job)):
                    store.compare_set(FINGERPRINT_KEY, current, current)  # the job's, as it wrote it
            except Exception as exc:  # noqa: BLE001 - keeping the key is best effort; the rendezvous says what is wrong
                log.info("could not write the job's configuration again (%s)", exc)
            return inner.next_rendezvous()

        return replace(inner, next_rendezvous=next_rendezvous)
    return layer
