"""Several hosts on one machine: each a network namespace with its own address (198.18.0.0/15, the
benchmarking range, only inside namespaces made here), host name and /etc/hosts, joined by a bridge that
lives in a namespace of its own. Faults are made the way a network makes them: a link taken down (packets
vanish, nobody answers with a reset) or an nftables drop inside a host's namespace (a silent cut).

    with Hosts() as hosts:                       # needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)
        a, b = hosts.add("n0"), hosts.add("n1")
        proc = hosts.popen(a, ["python", "-m", "http.server"])   # runs on host n0 as hostname n0
        hosts.cut(a, b)                          # n0 and n1 no longer hear each other (both=False: b hears a)
        hosts.heal()                             # every cut undone, every downed link up again
        hosts.link(b, up=False)                  # a blip: b's link down, its processes keep running
        hosts.vanish(b)                          # link down, then b's processes die: a VM reclaimed
        hosts.restart(b)                         # b back: link up, no cuts, no processes (start them again)

Names carry a run id, so parallel and crashed runs never collide. A state file per run
(/run/elastic-mnist-hosts/RUN.json, written before anything is created) names the owner pid; close() (also
on Ctrl-C, from the caller's `with`/finally) removes every namespace, link and /etc/netns dir, and every
new Hosts sweeps the leftovers of owners that died without closing (local/netns_owner.py).
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from elastic_mnist.files import atomic_write
from elastic_mnist.local.netns_owner import (
    PREFIX,
    STATE_DIR,
    HostsError,
    NotPermitted,
    check_permitted,
    kill_netns_processes,
    leftovers,
    netns_pids,
    remove_if_empty,
    remove_netns,
    start_time,
    sweep,
)
from elastic_mnist.local.netns_owner import run_tool as _ip

__all__ = ["PREFIX", "STATE_DIR", "Host", "Hosts", "HostsError", "NotPermitted", "check_permitted", "leftovers",
           "sweep"]

NETWORK, PREFIX_LEN = "198.18", 15
TABLE = "elastic_mnist_cut"  # the nftables table of cuts inside a host's namespace
_CLONE_NEWNET = 0x40000000
LINK_UP_DEADLINE_S = 10.0


def _is_up(netns: str, device: str) -> bool:
    return " state UP " in _ip("ip", "-n", netns, "-o", "link", "show", device).stdout


@dataclass
class Host:
    name: str
    """The host name its processes see (`hostname`) and every host's /etc/hosts maps to `address`."""
    netns: str
    address: str
    port: str
    """Its link's end on the bridge (in the bridge's namespace): down means the host is unreachable."""



class Hosts:
    """The hosts of one run (see the module docstring). Not thread-safe: one owner drives it."""

    def __init__(self, state_dir: str = STATE_DIR):
        check_permitted()
        sweep(state_dir)
        self.run_id = secrets.token_hex(3)
        self.state_path = os.path.join(state_dir, f"{self.run_id}.json")
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []  # namespaces, in creation order (recorded before each is made)
        self.bridge = f"{PREFIX}{self.run_id}-br"
        os.makedirs(state_dir, exist_ok=True)
        try:
            self._make_netns(self.bridge)
            _ip("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("ip", "-n", self.bridge, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _save(self) -> None:
        state = {"owner": os.getpid(), "owner_start": start_time(os.getpid()), "netns": self._made}
        atomic_write(self.state_path, json.dumps(state))

    def _make_netns(self, netns: str) -> None:
        self._made.append(netns)
        self._save()  # recorded first: a crash right after still leaves a sweepable record
        _ip("ip", "netns", "add", netns)
        _ip("ip", "-n", netns, "link", "set", "lo", "up")

    def add(self, name: str) -> Host:
        """A new host on the bridge, reachable by every other under `name`."""
        if name in self.hosts:
            raise HostsError(f"host {name!r} exists already in run {self.run_id}")
        index = len(self.hosts) + 2  # .1 is left free, as a gateway's would be
        host = Host(name, f"{PREFIX}{self.run_id}-{name}", f"{NETWORK}.{index // 256}.{index % 256}",
                    f"p{index}")
        self._make_netns(host.netns)
        self.hosts[name] = host
        _ip("ip", "-n", self.bridge, "link", "add", host.port, "type", "veth", "peer", "name", "eth0",
            "netns", host.netns)
        _ip("ip", "-n", self.bridge, "link", "set", host.port, "master", "br0", "up")
        _ip("ip", "-n", host.netns, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", "eth0")
        _ip("ip", "-n", host.netns, "link", "set", "eth0", "up")
        self._write_etc_hosts()
        return host

    def _write_etc_hosts(self) -> None:
        """Every host knows every other by name (`ip netns exec` mounts /etc/netns/NS/hosts on /etc/hosts)."""
        for host in self.hosts.values():
            lines = ["127.0.0.1 localhost", f"{host.address} {host.name}"]
            lines += [f"{h.address} {h.name}" for h in self.hosts.values() if h is not host]
            os.makedirs(f"/etc/netns/{host.netns}", exist_ok=True)
            with open(f"/etc/netns/{host.netns}/hosts", "w") as f:
                f.write("\n".join(lines) + "\n")

    def get(self, host: Host | str) -> Host:
        if isinstance(host, Host):
            return host
        if host not in self.hosts:
            raise HostsError(f"no host {host!r} in run {self.run_id} (hosts: {', '.join(self.hosts) or 'none'})")
        return self.hosts[host]

    def command(self, host: Host | str, argv: list[str]) -> list[str]:
        """argv run on `host`: in its namespace, with its /etc/hosts and its own host name (a UTS namespace).
        No fork on the way: the pid Popen returns is argv's."""
        h = self.get(host)
        return ["ip", "netns", "exec", h.netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                h.name, *argv]

    def popen(self, host: Host | str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **kw)

    def pids(self, host: Host | str) -> list[int]:
        return netns_pids(self.get(host).netns)

    def call(self, host: Host | str, fn, *args):
        """fn(*args) with its sockets on `host` (a thread that joined the host's namespace): the test
        process can dial a host's address or probe a path without starting a process there. Only the network
        is the host's: names resolve with this machine's /etc/hosts, so dial addresses (Host.address)."""
        netns, out = self.get(host).netns, {}

        def inside() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    out["error"] = HostsError(f"setns into {netns}: {os.strerror(ctypes.get_errno())}")
                    return
            finally:
                os.close(fd)
            try:
                out["value"] = fn(*args)
            except BaseException as e:  # handed to the caller's thread
                out["error"] = e

        thread = threading.Thread(target=inside, name=f"netns-{netns}", daemon=True)
        thread.start()
        thread.join()
        if "error" in out:
            raise out["error"]
        return out.get("value")

    # -- faults ---------------------------------------------------------------------------------
    def link(self, host: Host | str, up: bool) -> None:
        """Take the host's link on the bridge down (every packet to or from it is lost, silently) or up.
        Up returns once both ends report it: the kernel notices a carrier change a moment later (linkwatch)."""
        h = self.get(host)
        _ip("ip", "-n", self.bridge, "link", "set", h.port, "up" if up else "down")
        deadline = time.monotonic() + LINK_UP_DEADLINE_S
        while up and not (_is_up(self.bridge, h.port) and _is_up(h.netns, "eth0")):
            if time.monotonic() > deadline:
                raise HostsError(f"the link of host {h.name} is not up {LINK_UP_DEADLINE_S:.0f}s after `ip link set`")
            time.sleep(0.01)  # poll: there is no event to wait on from here

    def vanish(self, host: Host | str) -> None:
        """A VM reclaimed without notice: the link goes down first, so the dying processes' resets and
        FINs never reach anyone; then every process on the host is killed."""
        self.link(host, up=False)
        kill_netns_processes(self.get(host).netns)

    def cut(self, a: Host | str, b: Host | str, both: bool = True) -> None:
        """a's packets to b are dropped on arrival at b (silently: no reject, no reset); both=True drops
        b's packets to a as well."""
        ha, hb = self.get(a), self.get(b)
        self._drop(hb, ha.address)
        if both:
            self._drop(ha, hb.address)

    def _drop(self, at: Host, source: str) -> None:
        script = (f"add table inet {TABLE}\n"
                  f"add chain inet {TABLE} input {{ type filter hook input priority -10 ; }}\n"
                  f"add rule inet {TABLE} input ip saddr {source} drop\n")
        _ip("ip", "netns", "exec", at.netns, "nft", "-f", "-", stdin=script)

    def heal(self, *hosts: Host | str) -> None:
        """Undo the cuts on these hosts (default: all) and bring their links up again."""
        for h in [self.get(x) for x in hosts] or list(self.hosts.values()):
            _ip("ip", "netns", "exec", h.netns, "nft", "delete", "table", "inet", TABLE, check=False)
            self.link(h, up=True)

    def restart(self, host: Host | str) -> None:
        """The host boots again: no process left on it, no cut, its link up; start its processes anew."""
        h = self.get(host)
        kill_netns_processes(h.netns)
        self.heal(h)

    # -- cleanup --------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process on every host, remove every namespace (their links and the bridge go with
        them) and /etc/netns dir, then the state file. A Ctrl-C meanwhile waits until it is done."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for netns in reversed(self._made):
                remove_netns(netns)
            if os.path.exists(self.state_path):
                os.unlink(self.state_path)
            self._made, self.hosts = [], {}
            remove_if_empty(os.path.dirname(self.state_path))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


