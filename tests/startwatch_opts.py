"""The start watchdog's options and one decision, for its tests (tests/test_startwatch*.py)."""

from __future__ import annotations

from k8s_pods import T0

from elastic_mnist.ops import startwatch
from elastic_mnist.ops.startrules import Verdict, decide

DEADLINE, PENDING = 900.0, 1800.0
FAR = T0 + 10 * 86400  # long after every deadline
LABEL = "avoid.elastic-mnist.io/mnist"


def options(*extra: str):
    return startwatch.parse(["--selector=app.kubernetes.io/component=trainer", f"--avoid-label={LABEL}",
                             "--node-local-exit=preflight:69", *extra])


OPTS, SPOT = options(), options("--pending-deadline=0")


def verdict(p: dict, now: float, peers_ran_at: float = T0, opts=OPTS, mounts=(), marked=frozenset(),
            feasible=None) -> Verdict | None:
    return decide(p, now, opts, peers_ran_at, list(mounts), frozenset(marked), feasible)
