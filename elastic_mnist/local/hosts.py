"""`elastic-mnist local --hosts`: etcd and each node on a host of its own (a network namespace with its own
address, host name and /etc/hosts: local/netns.py), and the chaos verbs only hosts can have.

    elastic-mnist local --hosts --nodes 2 --chaos 'vanish:n1@step=30'             # a VM reclaimed
    elastic-mnist local --hosts --nodes 2 --chaos 'cut:n1-etcd@step=30'           # n1 loses etcd, not n0
    elastic-mnist local --hosts --nodes 2 --chaos 'down:n1@step=30,heal@after=4s' # a 4 s link blip

The run dir gets hosts.json (run id, each host's namespace and address). Everything made is removed when
the launcher ends, however it ends; a launcher killed outright is swept by the next run.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

from elastic_mnist.etcd.server import EtcdServer
from elastic_mnist.local import chaos
from elastic_mnist.local.netns import Host, Hosts

ETCD_HOST = "etcd"
ETCD_PORT = 2379  # etcd's own host: nothing else can hold the port there


class HostEtcd(EtcdServer):
    """The embedded etcd on a host of its own; its health probe runs from that host too."""

    def __init__(self, hosts: Hosts, host: Host, **kw) -> None:
        super().__init__(host=host.address, port=ETCD_PORT, **kw)
        self.hosts, self.on = hosts, host

    def _command(self) -> list[str]:
        return self.hosts.command(self.on, super()._command())

    def _wait_healthy(self, timeout: float) -> None:
        self.hosts.call(self.on, super()._wait_healthy, timeout)


def start_etcd(hosts: Hosts, data_dir: str, **kw) -> HostEtcd:
    """etcd (v3 API only unless enable_v2=True) on a new host named `etcd`, healthy when this returns."""
    kw.setdefault("enable_v2", False)
    return HostEtcd(hosts, hosts.add(ETCD_HOST), data_dir=data_dir, **kw).start()


class LauncherHosts:
    """The launcher's hosts: etcd's, and one per node made when the node first starts."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.hosts = Hosts()
        try:
            self.etcd_host = self.hosts.add(ETCD_HOST)
            self._record()
        except BaseException:
            self.hosts.close()
            raise

    def etcd(self, **kw) -> HostEtcd:
        """An EtcdServer (same keywords) that runs on the etcd host."""
        return HostEtcd(self.hosts, self.etcd_host, **kw)

    def wrap(self, node: str, command: list[str]) -> list[str]:
        """The node's command, run on the node's host (made on first use: a joining node brings its own)."""
        if node not in self.hosts.hosts:
            self.hosts.add(node)
            self._record()
        return self.hosts.command(node, command)

    def fire(self, fault: chaos.Fault, node) -> str:
        """Inject a host fault (chaos.HOST_KINDS) on `node` (a local.nodes.Node; None for heal); the
        event's label."""
        if fault.kind == "vanish":
            node.injected = True  # its agent dies of this fault: the node stays down
            self.hosts.vanish(node.name)
        elif fault.kind == "down":
            self.hosts.link(node.name, up=False)
        elif fault.kind == "cut":
            self.hosts.cut(node.name, fault.peer, both=fault.both)
            return f"{node.name}{'-' if fault.both else '>'}{fault.peer}"
        elif fault.kind == "heal":
            self.hosts.heal()
            return ""
        return node.name

    def _record(self) -> None:
        info = {"run_id": self.hosts.run_id, "bridge": self.hosts.bridge,
                "hosts": {h.name: {"netns": h.netns, "address": h.address} for h in self.hosts.hosts.values()}}
        with open(os.path.join(self.run_dir, "hosts.json"), "w") as f:
            json.dump(info, f, indent=2)

    def close(self) -> None:
        self.hosts.close()


@contextlib.contextmanager
def for_launcher(launcher) -> Iterator[None]:
    """Sets launcher.hosts for the run (None without --hosts) and removes every host afterwards."""
    if not launcher.args.hosts:
        yield
        return
    os.makedirs(launcher.args.run_dir, exist_ok=True)
    launcher.hosts = LauncherHosts(launcher.args.run_dir)
    try:
        yield
    finally:
        launcher.hosts.close()
