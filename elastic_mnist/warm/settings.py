"""The process settings a worker inherits from torchrun (and the wrappers it runs under) that a fork of the warm
process would not have: CPU affinity (torchrun's --numa-binding), resource limits, niceness, umask, scheduling
policy and priority (`chrt`), I/O priority (`ionice`), OOM score adjustment, no_new_privs (`setpriv
--no-new-privs`), and what confines it (confine.py: namespaces, capabilities, seccomp, groups). The stand-in
captures its own; the forked worker takes them over, or refuses (it cannot raise a hard limit or its
priority, lower its OOM score without CAP_SYS_RESOURCE, run on a CPU outside its cpuset, enter another
namespace or drop to other capabilities) and the worker starts cold instead, with one line saying why.

    python -c "from elastic_mnist.warm import settings; print(settings.capture())"

Standard library only: the stand-in captures them before torch is imported.
"""

from __future__ import annotations

import ctypes
import os
import resource

from elastic_mnist.warm import confine

LIMITS = sorted(name for name in dir(resource) if name.startswith("RLIMIT_"))
KEYS = ("affinity", "nice", "umask", "rlimits", "sched", "ioprio", "oom_score_adj", "no_new_privs", "confined")
_IOPRIO = {"x86_64": (251, 252), "aarch64": (30, 31)}.get(os.uname().machine)  # ioprio_set, ioprio_get
_IOPRIO_WHO_PROCESS, _PR_SET_NO_NEW_PRIVS, _PR_GET_NO_NEW_PRIVS = 1, 38, 39
_OOM = "/proc/self/oom_score_adj"
_MAX_CPU = 8192  # the largest CONFIG_NR_CPUS


def capture() -> dict:
    mask = os.umask(0)
    os.umask(mask)
    return {"affinity": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0), "umask": mask,
            "rlimits": {name: list(resource.getrlimit(getattr(resource, name))) for name in LIMITS},
            "sched": [os.sched_getscheduler(0), os.sched_getparam(0).sched_priority], "ioprio": _ioprio(),
            "oom_score_adj": _oom_score_adj(), "no_new_privs": bool(_prctl(_PR_GET_NO_NEW_PRIVS)),
            "confined": confine.capture()}


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int = 0) -> int:
    return _libc().prctl(option, value, 0, 0, 0)


def _ioprio(value: int | None = None) -> int | None:
    """This process's I/O priority (class << 13 | level); with `value`, set it first. None where unknown."""
    if _IOPRIO is None:
        return None
    libc = _libc()
    if value is not None and libc.syscall(_IOPRIO[0], _IOPRIO_WHO_PROCESS, 0, value) != 0:
        raise OSError(ctypes.get_errno(), f"ioprio_set({value}): {os.strerror(ctypes.get_errno())}")
    got = libc.syscall(_IOPRIO[1], _IOPRIO_WHO_PROCESS, 0)
    return got if got >= 0 else None


def _oom_score_adj() -> int:
    with open(_OOM) as f:
        return int(f.read())


def check(settings: dict) -> str:
    """"" when `settings` has the form `capture()` returns, else what is wrong with it (before any fork)."""
    if set(settings) != set(KEYS):
        return f"'settings' holds {sorted(settings)}, not {sorted(KEYS)}"
    cpus, limits, sched = settings["affinity"], settings["rlimits"], settings["sched"]
    if not (isinstance(cpus, list) and cpus and all(_int(c, 0, _MAX_CPU - 1) for c in cpus)):
        return f"'settings.affinity' is not a list of CPU numbers from 0 to {_MAX_CPU - 1}"
    for name, low, high, what in (("nice", -20, 19, "a niceness from -20 to 19"),
                                  ("umask", 0, 0o777, "a mode from 0 to 0o777"),
                                  ("oom_score_adj", -1000, 1000, "a score adjustment from -1000 to 1000")):
        if not _int(settings[name], low, high):
            return f"'settings.{name}' is not {what}"
    if not (settings["ioprio"] is None or _int(settings["ioprio"], 0, 0xFFFF)):
        return "'settings.ioprio' is not an I/O priority"
    if not (isinstance(sched, list) and len(sched) == 2 and _int(sched[0], 0, 2**31 - 1) and _int(sched[1], 0, 99)):
        return "'settings.sched' is not a [policy, priority] pair"
    if not isinstance(settings["no_new_privs"], bool) or not isinstance(settings["confined"], dict):
        return "'settings.no_new_privs' or 'settings.confined' is not of its type"
    if not isinstance(limits, dict) or not set(limits) <= set(LIMITS):
        return "'settings.rlimits' is not a map of RLIMIT_ names"
    for name, pair in limits.items():
        if not (isinstance(pair, list) and len(pair) == 2 and all(_int(x, -1, 2**63 - 1) for x in pair)):
            return f"'settings.rlimits.{name}' is not a [soft, hard] pair of limits"
    return confine.check(settings["confined"])


def _int(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def apply(settings: dict) -> str:
    """Take `settings` over in this process: "" when all of them took, else the first that did not (what
    confines the worker is compared first, before anything is changed)."""
    why = confine.difference(settings["confined"])
    if why:
        return why
    try:
        if settings["no_new_privs"] != bool(_prctl(_PR_GET_NO_NEW_PRIVS)):
            if not settings["no_new_privs"]:  # (a kept worker that took it for an earlier round)
                return "the worker runs without no_new_privs, and this process has it (it cannot be cleared)"
            if _prctl(_PR_SET_NO_NEW_PRIVS, 1) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        os.umask(int(settings["umask"]))
        wanted = set(map(int, settings["affinity"]))
        if wanted != os.sched_getaffinity(0):
            os.sched_setaffinity(0, wanted)
        for name, (soft, hard) in settings["rlimits"].items():
            if name in LIMITS and resource.getrlimit(getattr(resource, name)) != (soft, hard):
                resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))
        _priorities(settings)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"cannot take the worker's process settings over ({type(e).__name__}: {e})"
    return ""


def _priorities(settings: dict) -> None:
    """Scheduling policy (before the niceness: it keeps it), niceness, I/O priority, OOM score adjustment."""
    policy, priority = settings["sched"]
    if [os.sched_getscheduler(0), os.sched_getparam(0).sched_priority] != [policy, priority]:
        os.sched_setscheduler(0, policy, os.sched_param(priority))
    nice = int(settings["nice"])
    if os.getpriority(os.PRIO_PROCESS, 0) != nice:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    wanted = settings["ioprio"]
    if wanted is not None and _ioprio() != wanted:  # class 0 (none: from the niceness) takes no level of its own
        _ioprio(wanted if wanted >> 13 else 0)
    if _oom_score_adj() != settings["oom_score_adj"]:
        with open(_OOM, "w") as f:
            f.write(str(settings["oom_score_adj"]))
