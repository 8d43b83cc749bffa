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
