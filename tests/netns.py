"""pytest fixtures for several hosts on one machine (elastic_mnist/local/netns.py), registered in conftest.py:

    def test_something(hosts):                     # a netns.Hosts, removed after the test however it ends
        a, b = hosts.add("n0"), hosts.add("n1")
        hosts.cut(a, b)

    def test_with_etcd(hosts, etcd_host):          # etcd (v3 only) on a host named `etcd`, port 2379
        ... --rdzv-endpoint=etcd_host.endpoint, processes started with hosts.popen(host, argv) ...

Helpers: `dial(hosts, host, address, port)` (from `host`: "ok", "timeout" or "refused"; a cut or a downed
link is a timeout, never a refusal) and `assert_gone(run_id)` (no namespace, /etc/netns dir or process
of that run left). The fixture skips, naming why, only where network namespaces are not permitted (not
root); CI runs as root, so these tests run there.
"""

from __future__ import annotations

import os
import socket

import pytest

from elastic_mnist.local import netns
from elastic_mnist.local.hosts import HostEtcd, start_etcd

DIAL_TIMEOUT_S = 0.5  # a reachable host answers a SYN in well under a millisecond, even on a loaded CI box


def dial(hosts: netns.Hosts, host: netns.Host | str, address: str, port: int,
         timeout: float = DIAL_TIMEOUT_S) -> str:
    """A TCP connect from `host` to address:port (an address: names resolve with the machine's /etc/hosts
    here): 'ok', 'refused' (a reset came back) or 'timeout' (silence)."""

    def connect() -> str:
        try:
            socket.create_connection((address, port), timeout=timeout).close()
            return "ok"
        except ConnectionRefusedError:
            return "refused"
        except TimeoutError:
            return "timeout"

    return hosts.call(host, connect)


def assert_gone(run_id: str) -> None:
    mine = f"{netns.PREFIX}{run_id}-"
    assert [n for n in netns.leftovers() if n.startswith(mine)] == [], "a namespace of the run is left"
    etc = [d for d in os.listdir("/etc/netns") if d.startswith(mine)] if os.path.isdir("/etc/netns") else []
    assert etc == [], f"/etc/netns dirs left: {etc}"
    assert not os.path.exists(os.path.join(netns.STATE_DIR, f"{run_id}.json")), "its state file is left"


@pytest.fixture
def hosts():
    try:
        made = netns.Hosts()
    except netns.NotPermitted as e:
        pytest.skip(f"network namespaces are not permitted here: {e}")
    except netns.HostsError as e:  # a tool missing: one line naming the packages, not a traceback
        pytest.fail(str(e), pytrace=False)
    try:
        yield made
    finally:
        made.close()
    assert_gone(made.run_id)


@pytest.fixture
def etcd_host(hosts, tmp_path) -> HostEtcd:
    server = start_etcd(hosts, str(tmp_path / "etcd-data"), log_path=str(tmp_path / "etcd.log"))
    try:
        yield server
    finally:
        server.close()
