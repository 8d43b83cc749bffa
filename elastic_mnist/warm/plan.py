"""The request of a worker the warm process builds before its round, from the agent's plan (contract/warm.py),
so that a node joining a running job makes it wait only for the process-group change.

    python -c "from elastic_mnist.contract.warm import WorkerPlan; from elastic_mnist.warm.plan import request_for; \
print(request_for(WorkerPlan({'module': 'elastic_mnist.train'}, [], '.', 1), 0).preload)"

A worker started before its round gets torchrun's environment without the round's part; the stand-in of its
first round must then describe the same worker, or the worker is not used (become.differences).
"""

from __future__ import annotations

import ast
import functools
import os
import sys
import time

from elastic_mnist import files
from elastic_mnist.contract.warm import Request, WorkerPlan


def request_for(plan: WorkerPlan, local_rank: int, environ=os.environ) -> Request:
    """A stand-in's request for the worker of `local_rank`, before its round (no stdio, no settings)."""
    module = plan.target.get("module")
    if module is not None:
        import importlib.util

        spec = importlib.util.find_spec(module)
        argv0, path0 = (spec.origin if spec and spec.origin else module), plan.cwd
    else:
        argv0, path0 = plan.target["path"], os.path.dirname(plan.target["path"])
    env = {**environ, "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(plan.local_world_size)}
    return Request(exe=sys.executable, version=sys.version, argv=[argv0, *plan.args], path=[path0, *sys.path[1:]],
                   cwd=plan.cwd, env=env, target=plan.target, preload=list(declared_preload(argv0)),
                   started=time.time(), unbuffered=True, settings={})


_MAX_SCRIPT = 1 << 20


@functools.lru_cache(maxsize=8)
def declared_preload(script: str) -> tuple[str, ...]:
    """The modules `script` names in its `handoff(preload=(...))` call (literal strings only), which its
    warm process imports when it starts: one that a request names later is imported by the worker itself."""
    try:
        tree = ast.parse(files.read_regular(script, _MAX_SCRIPT, "worker script", "", follow_symlinks=True))
    except (OSError, ValueError, SyntaxError):
        return ()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "handoff":
            for keyword in node.keywords:
                if keyword.arg == "preload" and isinstance(keyword.value, (ast.Tuple, ast.List)):
                    names = [getattr(e, "value", None) for e in keyword.value.elts]
                    return tuple(n for n in names if isinstance(n, str))
    return ()
