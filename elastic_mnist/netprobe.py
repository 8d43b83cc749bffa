"""TCP probes of other hosts' agent beacons: who refused, who answered, who is silent, whose agent is frozen.

    python -c "from elastic_mnist.netprobe import probe; print(probe({'me': '127.0.0.1:1'}))"

A connection to a `host:port` tells three things apart. A refusal (a TCP reset) comes from the peer's own
kernel when nothing listens there: its host is up, its process is gone. A completed handshake says the host
is up and reachable from here; the kernel completes it into the listen backlog even while the process is
frozen (SIGSTOP) or busy. Silence (no answer within the timeout) says this host cannot reach that one now:
a vanished VM, a link down, a partition; a single lost SYN looks the same, so callers ask twice.
The agent's beacon (rendezvous/_liveness.py) sends one byte on every accepted connection, so `check`
can also tell a frozen agent: handshake, no byte.

The agents of the etcd-v3 backend probe each other while a round forms; a worker whose heartbeat is late
probes the beacons of its round's other nodes (worker/control.py), which the agent hands it in
$ELASTIC_MNIST_PEER_BEACONS (JSON: node -> host:port) when it starts it.
"""

from __future__ import annotations

import errno
import ipaddress
import selectors
import socket
import time
from typing import NamedTuple

PROBE_TIMEOUT_S = 0.3  # an agent's probe while a round forms: a reachable kernel answers in well under a millisecond


class Probe(NamedTuple):
    refused: set[str]
    """A TCP reset came back: nothing listens there any more."""
    answered: set[str]
    """The handshake completed: the host is up and reachable from here (the rest were silent)."""


def split_address(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` with a numeric host (a host name would mean a blocking DNS lookup)."""
    if address.startswith("["):
        host, _, tail = address[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port = address.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not HOST:PORT: {address!r}")
    ipaddress.ip_address(host)  # ValueError unless numeric
    return host, int(port)


def _connect(addresses: dict[str, str]) -> tuple[list[tuple[str, socket.socket, int]], list[socket.socket]]:
    """Start a non-blocking connect to each: (name, socket, immediate result) and every socket opened."""
    started, socks = [], []
    for name, address in addresses.items():
        try:
            host, port = split_address(address)
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        except (ValueError, OSError):
            continue  # not an address we can probe: no proof either way
        socks.append(s)
        s.setblocking(False)
        try:
            started.append((name, s, s.connect_ex((host, port))))
        except OSError:
            continue
    return started, socks


def _wait(sel: selectors.BaseSelector, timeout: float, on_ready) -> None:
    deadline = time.monotonic() + timeout
    while sel.get_map():
        # One last look at the deadline: a prober descheduled past it still counts what completed meanwhile.
        for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
            on_ready(key)
        if time.monotonic() >= deadline:
            break


def probe(addresses: dict[str, str], timeout: float = PROBE_TIMEOUT_S, read_byte: set[str] | None = None) -> Probe:
    """Connect to every `host:port` at once, within `timeout`: who refused, who answered. With `read_byte`
    (a set to fill), the names whose connection also delivered a byte within the same timeout."""
    sel, result = selectors.DefaultSelector(), Probe(set(), set())
    started, socks = _connect(addresses)
    for name, s, code in started:
        if code == errno.ECONNREFUSED:
            result.refused.add(name)
        elif code in (0, errno.EINPROGRESS):
            sel.register(s, selectors.EVENT_WRITE, name)

    def ready(key) -> None:
        s, name = key.fileobj, key.data
        if key.events & selectors.EVENT_READ:  # the beacon's byte (or its close: an agent alive enough to answer)
            read_byte.add(name)
            sel.unregister(s)
            return
        error = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        sel.unregister(s)
        if error == errno.ECONNREFUSED:
            result.refused.add(name)
        elif error == 0:
            result.answered.add(name)
            if read_byte is not None:
                sel.register(s, selectors.EVENT_READ, name)

    _wait(sel, timeout, ready)
    sel.close()
    for s in socks:
        s.close()
    return result


def check(addresses: dict[str, str], timeout: float) -> dict[str, str]:
    """Each name's verdict: "ok" (its agent answered, or its host refused: the host is up; or no address we
    can probe), "silent" (unreachable from here) or "frozen" (its host answered, its agent did not)."""
    spoke: set[str] = set()
    probeable = {name: address for name, address in addresses.items() if _probeable(address)}
    result = probe(probeable, timeout, read_byte=spoke)
    return {name: "ok" if name in spoke or name in result.refused or name not in probeable
            else "frozen" if name in result.answered else "silent" for name in addresses}


def _probeable(address: str) -> bool:
    try:
        split_address(address)
    except ValueError:
        return False  # not an address we can probe: no proof either way, so no verdict against it
    return True


def wait_for_listener(host: str, port: int, timeout: float, every: float = 0.01, stopped=None) -> bool:
    """Dial host:port until something accepts (True) or `timeout` passes; False at once when the host is
    silent or unknown (a refusal is the only answer worth dialling again for: the host is up, its server not yet),
    or when `stopped()` says the wait is no longer wanted."""
    deadline = time.monotonic() + timeout
    while not (stopped is not None and stopped()):
        try:
            with socket.create_connection((host, port), timeout=max(0.01, min(1.0, deadline - time.monotonic()))):
                return True
        except ConnectionRefusedError:
            if time.monotonic() + every >= deadline:
                return False
            time.sleep(every)
        except OSError:
            return False
    return False
