"""The worker this torchrun agent will start, read from the agent's own command line, and its flags checked
before anything starts.

    python -c "from elastic_mnist.rendezvous._plan import from_torchrun as f; print(f(['-m', 'elastic_mnist.train']))"

torchrun starts each worker as `python -u -m MODULE ARGS` or `python -u SCRIPT ARGS` (torch/distributed/run.py,
config_from_args); the plan (contract/warm.py) goes to the agent's warm process, which may build the worker
before its round.
"""

from __future__ import annotations

import os
import sys

from elastic_mnist.contract.warm import TRAIN_MODULE, WorkerPlan


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
