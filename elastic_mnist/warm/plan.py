"""The worker a torchrun agent will start, read from the agent's own command line, so that its warm process
can check the worker's flags and build the worker before the agent joins (a node joining a running job).

    python -c "from elastic_mnist.warm.plan import from_torchrun; print(from_torchrun(['-m', 'elastic_mnist.train']))"

torchrun starts each worker as `python -u -m MODULE ARGS` or `python -u SCRIPT ARGS` with its own environment
plus the round's variables (torch/distributed/run.py, config_from_args). A worker started before its round
gets that environment without the round's part; the stand-in of its first round must then describe the same
worker, or the worker is not used (become.differences).
"""

from __future__ import annotations

import ast
import functools
import os
import sys
import time
from dataclasses import asdict, dataclass

from elastic_mnist import files

TRAIN_MODULE = "elastic_mnist.train"


@dataclass(frozen=True)
class WorkerPlan:
    target: dict
    """{"module": name} or {"path": absolute script path}, as a stand-in's request names it."""
    args: list
    cwd: str
    local_world_size: int

    def request(self, local_rank: int, environ=os.environ) -> dict:
        """A stand-in's request for the worker of `local_rank`, before its round (no stdio, no settings)."""
        module = self.target.get("module")
        if module is not None:
            import importlib.util

            spec = importlib.util.find_spec(module)
            argv0, path0 = (spec.origin if spec and spec.origin else module), self.cwd
        else:
            argv0, path0 = self.target["path"], os.path.dirname(self.target["path"])
        env = {**environ, "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size)}
        return {"exe": sys.executable, "version": sys.version, "argv": [argv0, *self.args],
                "path": [path0, *sys.path[1:]], "cwd": self.cwd, "env": env, "target": self.target,
                "preload": list(declared_preload(argv0)), "started": time.time(),
                "unbuffered": True,
                "settings": {}}

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> WorkerPlan:
        return cls(dict(data["target"]), list(data["args"]), str(data["cwd"]), int(data["local_world_size"]))


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


def from_torchrun(argv: list[str] | None = None) -> WorkerPlan | None:
    """The plan of this torchrun agent (its command line); None when it runs no Python worker of its own
    (--no-python, --run-path) or was not started as torchrun (a launcher calling the agent API)."""
    from torch.distributed import run as torchrun

    try:
        args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
        nproc = torchrun.determine_local_world_size(args.nproc_per_node)
    except (SystemExit, ValueError, RuntimeError):
        return None
    if args.no_python or args.run_path or not args.training_script:
        return None
    script = args.training_script
    target = {"module": script} if args.module else {"path": os.path.abspath(script)}
    return WorkerPlan(target, list(args.training_script_args), os.getcwd(), int(nproc))


CHECK_TIMEOUT_S = 60.0


def check_flags(plan: WorkerPlan | None) -> str:
    """The one line a worker of `plan` would exit with for its flags ("" when they are good or the worker is
    not this package's): known before anything starts. Run as its own process, `python -m
    elastic_mnist.config --check ...` (no torch import, a fraction of a second)."""
    if plan is None or plan.target.get("module") != TRAIN_MODULE:
        return ""
    import subprocess

    try:
        done = subprocess.run([sys.executable, "-m", "elastic_mnist.config", "--check", *plan.args],
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, cwd=plan.cwd)
    except (OSError, subprocess.TimeoutExpired):
        return ""  # unknown is not wrong: the worker reports what it finds itself
    return done.stderr.strip().splitlines()[-1] if done.returncode and done.stderr.strip() else ""
