"""Several hosts on one machine (elastic_mnist/local/netns.py): real namespaces, real packets, real signals.

    PYTHONPATH=$PWD python -m pytest -q tests/test_netns.py        # as root (CI is); skipped, saying why, if not

Each fault is checked by what a peer sees: a cut or a downed link is silence (a connect times out), never
a reset; every test's fixture asserts afterwards that nothing of its run is left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO, worker_env
from netns import assert_gone, dial

from elastic_mnist import netprobe, procs
from elastic_mnist.local import netns

PORT = 7000  # inside hosts made for this test: nothing else can hold it there


def listen(hosts, host, port: int = PORT) -> socket.socket:
    """A listening socket on `host`: the kernel completes handshakes without accept()."""
    def make() -> socket.socket:
        s = socket.socket()
        s.bind(("0.0.0.0", port))
        s.listen(16)
        return s
    return hosts.call(host, make)


def test_each_host_has_its_own_address_name_and_hosts_file(hosts):
    a, b = hosts.add("n0"), hosts.add("n1")
    out = subprocess.run(hosts.command(a, ["sh", "-c", "hostname; getent hosts n1; ip -4 -o addr show eth0"]),
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "n0" and out[1].split() == [b.address, "n1"] and f"{a.address}/15" in out[2]
    assert a.address.startswith("198.18.") and a.address != b.address
    assert socket.gethostname() != "n0", "the machine's own host name is untouched"
    with listen(hosts, b):
        assert dial(hosts, a, b.address, PORT) == "ok"


def test_a_cut_is_silent_both_ways_and_heal_undoes_it(hosts):
    a, b = hosts.add("n0"), hosts.add("n1")
    with listen(hosts, a), listen(hosts, b):
        hosts.cut(a, b)
        assert (dial(hosts, b, a.address, PORT), dial(hosts, a, b.address, PORT)) == ("timeout", "timeout")
        hosts.heal()
        assert (dial(hosts, b, a.address, PORT), dial(hosts, a, b.address, PORT)) == ("ok", "ok")


def test_a_one_way_cut_loses_only_that_direction(hosts):
    a, b = hosts.add("n0"), hosts.add("n1")
    hosts.cut(a, b, both=False)  # a's packets to b are lost; b's reach a

    def udp(port):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("0.0.0.0", port))
        s.settimeout(0.5)
        return s

    at_a, at_b = hosts.call(a, udp, PORT), hosts.call(b, udp, PORT)
    with at_a, at_b:
        at_a.sendto(b"from a", (b.address, PORT))
        at_b.sendto(b"from b", (a.address, PORT))
        assert at_a.recvfrom(64)[0] == b"from b"
        with pytest.raises(TimeoutError):
            at_b.recvfrom(64)


def test_a_downed_link_is_silence_not_a_reset_and_comes_back(hosts):
    a, b = hosts.add("n0"), hosts.add("n1")
    assert dial(hosts, a, b.address, PORT) == "refused", "up: nothing listens, the kernel answers"
    hosts.link(b, up=False)
    assert dial(hosts, a, b.address, PORT) == "timeout"
    hosts.link(b, up=True)
    assert dial(hosts, a, b.address, PORT) == "refused"


def test_vanish_kills_every_process_on_the_host_and_restart_brings_it_back_empty(hosts):
    a, b = hosts.add("n0"), hosts.add("n1")
    proc = hosts.popen(b, ["sleep", "600"])
    deadline = time.monotonic() + 10

    def argv() -> list[str]:
        with open(f"/proc/{proc.pid}/cmdline") as f:
            return f.read().split("\0")[:2]

    while argv() != ["sleep", "600"] and time.monotonic() < deadline:  # until `hostname` ran and sleep is exec'd
        time.sleep(0.01)
    assert argv() == ["sleep", "600"] and hosts.pids(b) == [proc.pid], "the program's own pid: no wrapper left"
    hosts.vanish(b)
    assert proc.wait(timeout=10) == -signal.SIGKILL and hosts.pids(b) == []
    assert dial(hosts, a, b.address, PORT) == "timeout"
    hosts.restart(b)
    # n0's neighbour entry for n1 failed while the link was down: its first SYN may wait on a new ARP
    # round, so the host is asked until it answers (a reset: up, nothing listening), within 10 s.
    procs.wait_for(lambda: dial(hosts, a, b.address, PORT) == "refused", 10, "the restarted host to answer")


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")
def test_everything_is_removed_when_the_owner_fails():
    with pytest.raises(RuntimeError, match="test failed"):
        with netns.Hosts() as made:
            run_id = made.run_id
            made.add("n0")
            made.popen("n0", ["sleep", "600"])
            raise RuntimeError("test failed")
    assert_gone(run_id)


# Ctrl-C at a terminal: a test run started as a background job inherits SIGINT ignored, and Python then
# installs no handler of its own, so the owner puts the default one back.
OWNER = """
import os, signal, sys, time
from elastic_mnist.local.netns import Hosts
signal.signal(signal.SIGINT, signal.default_int_handler)
with Hosts() as hosts:
    hosts.add("n0")
    hosts.popen("n0", ["sleep", "600"])
    print(hosts.run_id, flush=True)
    if sys.argv[1] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)  # until the signal the test sends
"""


def _owner(how: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, how], stdout=subprocess.PIPE, text=True,
                            env=worker_env(), cwd=REPO)
    return proc, proc.stdout.readline().strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")
def test_ctrl_c_removes_everything_and_a_killed_owner_is_swept():
    proc, run_id = _owner("wait")
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert_gone(run_id)
    proc, run_id = _owner("die")
    assert proc.wait(timeout=30) == -signal.SIGKILL
    state = json.load(open(os.path.join(netns.STATE_DIR, f"{run_id}.json")))
    assert all(n in netns.leftovers() for n in state["netns"]), "killed outright: nothing was removed"
    assert set(state["netns"]) <= set(netns.sweep())
    assert_gone(run_id)


@pytest.mark.skipif(os.geteuid() != 0, reason="checks the refusal by dropping root, which needs root")
def test_hosts_without_root_is_one_clear_line(small_mnist, tmp_path):
    os.chmod(tmp_path, 0o777)
    run = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                          "elastic_mnist", "local", "--hosts", "--run-dir", str(tmp_path / "run"),
                          "--data-dir", small_mnist], capture_output=True, text=True, env=worker_env(), cwd=REPO,
                         timeout=60)
    assert run.returncode != 0 and "need root" in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_etcd_on_its_own_host_is_reached_through_the_bridge_only(hosts, etcd_host):
    """The etcd_host fixture: healthy (probed from its own host), reachable from a node host, cut for real."""
    n0 = hosts.add("n0")
    address, port = etcd_host.endpoint.split(":")
    assert etcd_host.is_running() and address == hosts.get("etcd").address
    assert dial(hosts, n0, address, int(port)) == "ok"
    hosts.cut(n0, "etcd")
    assert dial(hosts, n0, address, int(port)) == "timeout"
    assert etcd_host.pid in hosts.pids("etcd"), "etcd runs on its host, under its own pid"


def test_a_probe_tells_a_silent_host_from_a_frozen_agent(hosts):
    """netprobe.check from n0: n1's listening port without accept (a frozen agent) and a closed port (its
    host refuses) while the path is up; both silent once n0 and n1 are cut."""
    a, b = hosts.add("n0"), hosts.add("n1")
    addresses = {"frozen": f"{b.address}:{PORT}", "closed": f"{b.address}:{PORT + 1}"}
    with listen(hosts, b):
        assert hosts.call(a, netprobe.check, addresses, 0.4) == {"frozen": "frozen", "closed": "ok"}
        hosts.cut(a, b)
        assert hosts.call(a, netprobe.check, addresses, 0.4) == {"frozen": "silent", "closed": "silent"}
