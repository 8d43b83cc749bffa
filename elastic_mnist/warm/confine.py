"""What confines a process that a fork of the warm process cannot take over: its namespaces (`unshare -n`, a
container), its capabilities (`setpriv`, `capsh`), its seccomp filter, its groups. A worker whose stand-in
differs in any of them starts cold, with one line saying which: a warm worker never runs with more
privilege, or in another place, than a cold one would. no_new_privs can be carried (one-way): settings.py.

    python -c "from elastic_mnist.warm import confine; print(confine.capture())"

Standard library only: the stand-in captures them before torch is imported.
"""

from __future__ import annotations

import os

NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts")
STATUS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "Seccomp")


def capture() -> dict:
    """This process's namespaces (their inodes), capabilities, seccomp mode and groups."""
    namespaces = {}
    for name in NAMESPACES:
        try:
            namespaces[name] = os.stat(f"/proc/self/ns/{name}").st_ino
        except OSError:
            continue  # a kernel without it
    return {"ns": namespaces, "status": _status(STATUS), "groups": [os.getgid(), *sorted(os.getgroups())]}


def _status(names) -> dict:
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return {}
    return {name: fields[name].strip() for name in names if name in fields}


def check(confined: dict) -> str:
    """"" when `confined` has the form `capture()` returns, else what is wrong with it."""
    ns, status, groups = confined.get("ns"), confined.get("status"), confined.get("groups")
    if not (isinstance(ns, dict) and set(ns) <= set(NAMESPACES) and all(_count(v) for v in ns.values())):
        return "'settings.confined.ns' is not a map of namespace inodes"
    if not (isinstance(status, dict) and set(status) <= set(STATUS)
            and all(isinstance(v, str) and len(v) <= 32 for v in status.values())):
        return "'settings.confined.status' is not a map of capability sets"
    if not (isinstance(groups, list) and groups and all(_count(g) for g in groups)):
        return "'settings.confined.groups' is not a list of group ids"
    return ""


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def difference(wanted: dict) -> str:
    """Why this process (a fork of the warm process) cannot be the worker confined as `wanted` ("" if it can)."""
    here = capture()
    namespaces = [n for n in NAMESPACES if n in wanted["ns"] and wanted["ns"][n] != here["ns"].get(n)]
    if namespaces:
        return (f"the worker runs in another {', '.join(namespaces)} namespace than the warm process (unshare, "
                "a container), and a fork cannot enter it")
    status = [f"{k} {wanted['status'][k]} (warm: {here['status'].get(k)})" for k in STATUS
              if k in wanted["status"] and wanted["status"][k] != here["status"].get(k)]
    if status:
        return (f"the worker runs with other capabilities or seccomp than the warm process ({'; '.join(status)}), "
                "and a fork would keep the warm process's")
    if wanted["groups"] != here["groups"]:
        return "the worker runs with other groups than the warm process, and a fork would keep the warm process's"
    return ""
