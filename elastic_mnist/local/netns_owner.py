"""What a run of hosts (local/netns.py) owns, and how it is removed: the state file naming the owner,
killing a namespace's processes, deleting namespaces, and the sweep of runs whose owner died.

    python -m elastic_mnist.local.netns_owner --sweep     # remove what dead runs left behind (root)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

from elastic_mnist.contract.errors import UserError

STATE_DIR = "/run/elastic-mnist-hosts"
PREFIX = "emh-"  # every namespace made here: emh-RUN-HOST
KILL_DEADLINE_S = 10.0
_TOOLS = ("ip", "nft", "unshare")


class HostsError(UserError):
    """A namespace could not be made or changed; the message names the command and what it said."""


class NotPermitted(HostsError):
    """This process may not make network namespaces (not root, or a container without CAP_SYS_ADMIN)."""


def run_tool(*args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run ip/nft; a failure is one HostsError line naming the command and what it said."""
    run = subprocess.run(list(args), input=stdin, capture_output=True, text=True)
    if check and run.returncode != 0:
        err = run.stderr.strip().splitlines()[-1:] or ["(no output)"]
        cls = NotPermitted if "not permitted" in err[0].lower() else HostsError
        raise cls(f"`{' '.join(args)}` failed: {err[0]}" + (
            "; network namespaces need root (run as root, or in a container with --privileged)"
            if cls is NotPermitted else ""))
    return run


def check_permitted() -> None:
    """Raise NotPermitted (one line naming the fix) unless this process can make network namespaces."""
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        raise HostsError(f"{', '.join(missing)} not found: install iproute2, nftables and util-linux "
                         "(apt-get install iproute2 nftables util-linux)")
    if os.geteuid() != 0:
        raise NotPermitted("several hosts on one machine need network namespaces, which need root: run as root "
                           "(or in a container with --privileged)")


def start_time(pid: int) -> str | None:
    """The kernel's start time of pid (field 22 of /proc/PID/stat): a reused pid has another one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def netns_pids(netns: str) -> list[int]:
    found = run_tool("ip", "netns", "pids", netns, check=False)
    return [int(p) for p in found.stdout.split()] if found.returncode == 0 else []


def kill_netns_processes(netns: str) -> None:
    """SIGKILL every process in the namespace until none is left (a dying parent may fork once more)."""
    deadline = time.monotonic() + KILL_DEADLINE_S
    while (pids := netns_pids(netns)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)  # poll until the kernel has reaped them; there is no event to wait on


def remove_netns(netns: str) -> None:
    kill_netns_processes(netns)
    if os.path.exists(f"/run/netns/{netns}"):
        run_tool("ip", "netns", "del", netns, check=False)  # its veths (and the bridge) go with it
    shutil.rmtree(f"/etc/netns/{netns}", ignore_errors=True)


def sweep(state_dir: str = STATE_DIR) -> list[str]:
    """Remove what runs whose owner died left behind (namespaces, /etc/netns dirs); the names removed."""
    removed = []
    for entry in sorted(os.listdir(state_dir)) if os.path.isdir(state_dir) else []:
        path = os.path.join(state_dir, entry)
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, ValueError):
            continue
        if start_time(state["owner"]) == state["owner_start"]:
            continue  # its owner lives and will clean up itself
        for netns in state["netns"]:
            remove_netns(netns)
            removed.append(netns)
        os.unlink(path)
    remove_if_empty(state_dir)
    return removed


def remove_if_empty(state_dir: str) -> None:
    """The shared dirs go with the last run that used them (another run may be using them still)."""
    for shared in ("/etc/netns", state_dir):
        try:
            os.rmdir(shared)
        except OSError:
            pass


def leftovers() -> list[str]:
    """Namespaces made here that still exist (any run): what a test asserts is empty for its own run."""
    return [line.split()[0] for line in run_tool("ip", "netns", "list").stdout.splitlines()
            if line.startswith(PREFIX)]


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--sweep"]:
        sys.exit("usage: python -m elastic_mnist.local.netns_owner --sweep   (remove hosts of runs whose owner died)")
    print("\n".join(sweep()) or "nothing left behind")
