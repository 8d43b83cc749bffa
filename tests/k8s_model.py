"""A model of what the Job controller, the scheduler and the start watchdog do with the rendered trainer Job,
each step in the order their source has it, for tests/test_k8s_policy.py. The pod objects are the API's
(tests/k8s_pods.py) and the watchdog's decisions are its own code (elastic_mnist/ops/startrules.py).

    python -m pytest -q tests/test_k8s_policy.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k8s_manifests import container, pod_spec, resolve_env
from k8s_pods import T0, exited, pod, running, waiting

from elastic_mnist.contract import exit_codes
from elastic_mnist.ops import startrules


def job_outcome(spec: dict, failed: int, succeeded: int) -> str | None:
    """The Job controller's decision in one sync, in its order (kubernetes/kubernetes
    pkg/controller/job/job_controller.go, syncJob, Indexed Jobs with backoffLimitPerIndex): the
    failed-indexes checks first, the success policy only if neither fired."""
    if spec.get("maxFailedIndexes") is not None and failed > spec["maxFailedIndexes"]:
        return "Failed: MaxFailedIndexesExceeded"
    if failed > 0 and failed + succeeded >= spec["completions"]:
        return "Failed: FailedIndexes"
    if any(succeeded >= rule["succeededCount"] for rule in spec["successPolicy"]["rules"]):
        return "Complete"
    return None


def pod_rule(rules: list[dict], p: dict) -> tuple[int | None, str]:
    """matchPodFailurePolicy (pkg/controller/job/pod_failure_policy.go) on a Failed pod: the first rule that
    matches decides, (its index, its action); none matching counts against backoffLimitPerIndex."""
    status = p["status"]
    assert status["phase"] == "Failed", "with a podFailurePolicy only Failed pods are matched (isPodFailed)"
    for i, rule in enumerate(rules):
        if "onExitCodes" in rule:
            req = rule["onExitCodes"]
            for s in status.get("containerStatuses", []) + status.get("initContainerStatuses", []):
                code = s["state"].get("terminated", {}).get("exitCode", 0)
                if code and req.get("containerName") in (None, s["name"]) and \
                        (code in req["values"]) == (req["operator"] == "In"):
                    return i, rule["action"]
        elif any((c["type"], c["status"]) == (r["type"], r["status"])
                 for c in status.get("conditions", []) for r in rule["onPodConditions"]):
            return i, rule["action"]
    return None, "Count"


# pkg/controller/job/job_controller.go: DefaultJobPodFailureBackOff, MaxJobPodFailureBackOff.
POD_FAILURE_BACKOFF_S, MAX_POD_FAILURE_BACKOFF_S = 10.0, 600.0


def index_backoff(earlier_failures: int) -> float:
    """How long the Job controller waits, from the end of a failed pod, before it creates the index's next pod
    (backoff_utils.go, getRemainingTimePerIndex at the moment of the failure): the failed pod's absolute count
    (getIndexAbsoluteFailureCount: its job-index-failure-count plus job-index-ignored-failure-count annotations, the
    index's earlier failures, counted and ignored alike) plus one, into getRemainingTimeForFailuresCount: 10 s,
    doubled per earlier failure, capped at 10 minutes."""
    delay = POD_FAILURE_BACKOFF_S
    for _ in range(earlier_failures):
        delay *= 2
        if delay >= MAX_POD_FAILURE_BACKOFF_S:
            return MAX_POD_FAILURE_BACKOFF_S
    return delay


@dataclass
class JobModel:
    """One Indexed Job's bookkeeping: failed and succeeded indexes, counted and ignored failures per index (the
    annotations getNewIndexFailureCounts, indexed_job_utils.go, gives each replacement pod)."""
    spec: dict
    failed: set[int] = field(default_factory=set)
    succeeded: set[int] = field(default_factory=set)
    counted: dict[int, int] = field(default_factory=dict)
    ignored: dict[int, int] = field(default_factory=dict)
    failed_job: bool = False

    def pod_failed(self, index: int, p: dict) -> str:
        """Apply the podFailurePolicy to a Failed pod of `index`; the rule's action. The index fails on a counted
        failure once backoffLimitPerIndex earlier ones were counted (isIndexFailed: the failed pod's failure-count
        annotation >= the limit)."""
        _, action = pod_rule(self.spec["podFailurePolicy"]["rules"], p)
        if action == "FailJob":
            self.failed_job = True
        elif action == "FailIndex":
            self.failed.add(index)
        elif action == "Count":
            self.counted[index] = self.counted.get(index, 0) + 1
            if self.counted[index] > self.spec["backoffLimitPerIndex"]:
                self.failed.add(index)
        else:
            self.ignored[index] = self.ignored.get(index, 0) + 1
        return action

    def replacement_delay(self, index: int) -> float:
        """The wait before the index's next pod, after the failure just recorded (counted and ignored alike)."""
        return index_backoff(self.counted.get(index, 0) + self.ignored.get(index, 0) - 1)

    def outcome(self) -> str | None:
        if self.failed_job:
            return "Failed: PodFailurePolicy"
        return job_outcome(self.spec, len(self.failed), len(self.succeeded))

    def pending(self, active: set[int], count: int) -> list[int]:
        """firstPendingIndexes (pkg/controller/job/indexed_job_utils.go): the lowest indexes not active,
        succeeded or failed."""
        taken = active | self.succeeded | self.failed
        return [i for i in range(self.spec["completions"]) if i not in taken][:count]


def node_matches(terms: list[dict], labels: dict[str, str]) -> bool:
    """A required nodeAffinity (nodeSelectorTerms are ORed, their expressions ANDed), as the scheduler's
    NodeAffinity plugin reads it; no terms: any node."""
    ops = {"In": lambda k, v: labels.get(k) in v, "NotIn": lambda k, v: labels.get(k) not in v,
           "Exists": lambda k, v: k in labels, "DoesNotExist": lambda k, v: k not in labels}
    return not terms or any(all(ops[e["operator"]](e["key"], e.get("values", [])) for e in t["matchExpressions"])
                            for t in terms)


@dataclass
class Trainer:
    index: int
    node: str
    fails_at: float | None  # when preflight's node-local exit ends it (None: it trains)
    obj: dict


class BadNodeRun:
    """Trainer pods of the rendered Job on `nodes` GPU nodes, `bad` lacking what preflight checks (exit 69
    after its ELASTIC_MNIST_NODE_LOCAL_HOLD_S). The scheduler is adversarial: of the nodes the rules allow it
    picks the bad one first (the only node without a trainer usually is). The watchdog sweeps every
    --interval, first deciding on the pods with the marks it listed, then marking (startwatch.sweep)."""

    def __init__(self, job: dict, opts, nodes: int, bad: str = "n0", parallelism: int | None = None):
        self.job, self.opts, self.bad = job, opts, bad
        self.model = JobModel(dict(job["spec"], parallelism=parallelism or job["spec"]["parallelism"]))
        env = resolve_env(job, container(job, "preflight"))
        self.hold = float(env.get("ELASTIC_MNIST_NODE_LOCAL_HOLD_S") or 0)
        self.labels: dict[str, dict[str, str]] = {f"n{i}": {} for i in range(nodes)}
        affinity = pod_spec(job)["affinity"]
        self.terms = affinity.get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", {}) \
            .get("nodeSelectorTerms", [])
        self.one_per_node = "podAntiAffinity" in affinity
        self.active: list[Trainer] = []
        self.failures: list[tuple[int, str]] = []  # (index, node) of every FailIndex

    def _place(self, index: int, now: float) -> None:
        busy = {t.node for t in self.active} if self.one_per_node else set()
        nodes = sorted(self.labels, key=lambda n: (n != self.bad, n))
        fits = [n for n in nodes if n not in busy and node_matches(self.terms, self.labels[n])]
        if not fits:
            return  # Pending, unschedulable: the next round tries again
        node = fits[0]
        fails = now + 2 + self.hold if node == self.bad else None
        obj = pod(name=f"trainer-{index}-x", uid=f"u-{index}-{now}", node=node, started=T0 + now,
                  init=[running("preflight", T0 + now)], containers=[waiting("trainer", "PodInitializing")])
        self.active.append(Trainer(index, node, fails, obj))

    def _replace(self, now: float) -> None:
        want = self.model.spec["parallelism"] - len(self.active)
        for index in self.model.pending({t.index for t in self.active}, want):
            self._place(index, now)

    def _end(self, t: Trainer, failed: dict) -> None:
        self.active.remove(t)
        self.ended.append(failed)
        if self.model.pod_failed(t.index, failed) == "FailIndex":
            self.failures.append((t.index, t.node))

    def _sweep(self, now: float) -> None:
        marks = {n: v[self.opts.avoid_label] for n, v in self.labels.items() if self.opts.avoid_label in v}
        for t in list(self.active):
            verdict = startrules.decide(t.obj, T0 + now, self.opts, T0 + now, [], frozenset(marks))
            if verdict and verdict.end:  # the watchdog's patch and delete; preflight answers SIGTERM with 143
                cond = {"type": verdict.condition, "status": "True", "reason": verdict.reason}
                self._end(t, exited("preflight", exit_codes.killed_by(15), node=t.node, conditions=[cond],
                                    name=t.obj["metadata"]["name"], uid=t.obj["metadata"]["uid"]))
        for failed in self.ended:
            if self.opts.avoid_label and startrules.node_local_failure(failed, self.opts.node_local_exit):
                self.labels[failed["spec"]["nodeName"]][self.opts.avoid_label] = str(int(T0 + now))
                failed["status"]["conditions"].append({"type": startrules.NODE_MARKED, "status": "True"})

    def run(self, seconds: int, phase: int, down_until: float = 0) -> str | None:
        """Second by second: node-local exits (the Job controller replaces at once), then a sweep when due (none
        before `down_until`: a watchdog restarting, its image pulling, its API calls timing out)."""
        self.ended: list[dict] = []
        self._replace(0)
        for now in range(seconds):
            for t in [t for t in self.active if t.fails_at is not None and t.fails_at <= now]:
                self._end(t, exited("preflight", exit_codes.NODE_LOCAL, node=t.node, name=t.obj["metadata"]["name"],
                                    uid=t.obj["metadata"]["uid"]))
                self._replace(now)
            if now % self.opts.interval == phase and now >= down_until:
                self._sweep(now)
                self._replace(now)
            if self.model.outcome():
                break
        return self.model.outcome()

    def training(self) -> list[Trainer]:
        return [t for t in self.active if t.fails_at is None]

