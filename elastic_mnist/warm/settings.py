"""The process settings a worker inherits from torchrun that a fork of the warm process would not have:
CPU affinity (torchrun's --numa-binding), resource limits, niceness and umask. The stand-in captures its
own; the forked worker takes them over, or refuses (it cannot raise a hard limit or its priority, nor run on
a CPU outside its cpuset) and the worker starts cold instead, with one line saying why.

    python -c "from elastic_mnist.warm import settings; print(settings.capture())"

Standard library only: the stand-in captures them before torch is imported.
"""

from __future__ import annotations

import os
import resource

LIMITS = sorted(name for name in dir(resource) if name.startswith("RLIMIT_"))


def capture() -> dict:
    mask = os.umask(0)
    os.umask(mask)
    return {"affinity": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0), "umask": mask,
            "rlimits": {name: list(resource.getrlimit(getattr(resource, name))) for name in LIMITS}}


_MAX_CPU = 8192  # the largest CONFIG_NR_CPUS


def check(settings: dict) -> str:
    """"" when `settings` has the form `capture()` returns, else what is wrong with it (before any fork)."""
    if set(settings) != {"affinity", "nice", "umask", "rlimits"}:
        return f"'settings' holds {sorted(settings)}, not {sorted(['affinity', 'nice', 'umask', 'rlimits'])}"
    cpus, nice, mask, limits = settings["affinity"], settings["nice"], settings["umask"], settings["rlimits"]
    if not (isinstance(cpus, list) and cpus and all(_int(c, 0, _MAX_CPU - 1) for c in cpus)):
        return f"'settings.affinity' is not a list of CPU numbers from 0 to {_MAX_CPU - 1}"
    if not _int(nice, -20, 19):
        return "'settings.nice' is not a niceness from -20 to 19"
    if not _int(mask, 0, 0o777):
        return "'settings.umask' is not a mode from 0 to 0o777"
    if not isinstance(limits, dict) or not set(limits) <= set(LIMITS):
        return "'settings.rlimits' is not a map of RLIMIT_ names"
    for name, pair in limits.items():
        if not (isinstance(pair, list) and len(pair) == 2 and all(_int(x, -1, 2**63 - 1) for x in pair)):
            return f"'settings.rlimits.{name}' is not a [soft, hard] pair of limits"
    return ""


def _int(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def apply(settings: dict) -> str:
    """Take `settings` over in this process: "" when all of them took, else the first that did not."""
    try:
        os.umask(int(settings["umask"]))
        wanted = set(map(int, settings["affinity"]))
        if wanted != os.sched_getaffinity(0):
            os.sched_setaffinity(0, wanted)
        for name, (soft, hard) in settings["rlimits"].items():
            if name in LIMITS and resource.getrlimit(getattr(resource, name)) != (soft, hard):
                resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))
        nice = int(settings["nice"])
        if os.getpriority(os.PRIO_PROCESS, 0) != nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"cannot take the worker's process settings over ({type(e).__name__}: {e})"
    return ""
