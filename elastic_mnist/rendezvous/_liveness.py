"""A killed node leaves the rendezvous as soon as its agent's port refuses a connection, not after the
keep-alive window.

    torchrun --rdzv-backend=etcd-v3 ...                            # on by default
    torchrun --rdzv-backend=etcd-v3 --rdzv-conf peer_probe=0 ...   # off: the keep-alive window alone

Each agent listens on a TCP port of the address it reaches etcd from (its "beacon") and publishes
`host:port` under `{prefix}/{run_id}/probe/{node}`, sealed with the job's secret when it has one. While a
round is being formed (someone waits, or the round is open), the survivors connect to the beacons of the
other participants. Only a refusal counts: a TCP reset comes from the peer's own kernel when nothing
listens on that port any more, so the agent process is gone (SIGKILL, OOM kill, crash) while its host is
up. A live agent never refuses, even frozen (SIGSTOP): its kernel completes the handshake into the
backlog. A host that vanished answers nothing; a timeout proves nothing, and the keep-alive window
decides as before. So a probe can only shorten the wait for a node that is certainly dead.

With a secret, a beacon's value is sealed with its place in the key's history (_ordered.py): an older
value of an agent written back (its "cannot reach B" after the cut healed) is ignored by every reader,
and the agent, which reads its own key with everyone else's, writes its current value again.

A node judged dead that writes a newer heartbeat is taken back (_prompt.RoundView). A network policy
that *rejects* (not drops) traffic to the beacon port would still drop live nodes from every round that
forms; allow agent-to-agent TCP within the job, or set peer_probe=0.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterable

from elastic_mnist.contract.env import set_peer_beacons
from elastic_mnist.contract.keys import BEACONS_LEAF
from elastic_mnist.etcd.client import EtcdV3Client, EtcdV3Error, run_key
from elastic_mnist.etcd.lease import LeaseKeeper
from elastic_mnist.etcd.rdzv_state import StateIntegrityError
from elastic_mnist.netprobe import PROBE_TIMEOUT_S, probe, split_address
from elastic_mnist.rendezvous import _ordered
from elastic_mnist.rendezvous._partition import CONFIRM_S, decode, encode

RECHECK_S = 0.5  # a peer that answered is asked again after this long, at the earliest


def advertised_host(etcd_host: str, etcd_port: int) -> str:
    """The local address this host reaches etcd from: the one peers can reach us on, too."""
    family, _, _, _, addr = socket.getaddrinfo(etcd_host, etcd_port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)  # UDP: nothing is sent, the kernel only picks the route
        return s.getsockname()[0]


class Beacon:
    """A listening socket that accepts connections, answers one byte (`status()`: b"1" while this agent
    reaches etcd, else b"0") and drops them, for as long as this process lives."""

    def __init__(self, host: str, status: Callable[[], bytes] = lambda: b"0") -> None:
        self._status = status
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.address = f"[{host}]:{self.port}" if family == socket.AF_INET6 else f"{host}:{self.port}"
        threading.Thread(target=self._serve, name="rdzv-beacon", daemon=True).start()

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def _serve(self) -> None:
        # Accepting only keeps the backlog from filling: the handshake already told the prober we live.
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            try:
                conn.send(self._status())  # one byte into a fresh socket's buffer: never blocks
            except OSError:
                pass  # the prober only wanted the handshake
            conn.close()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept(); close() alone does not
        except OSError:
            pass
        self._sock.close()


class PeerLiveness:
    """Publishes this agent's beacon and tells which of the named nodes are certainly gone."""

    def __init__(self, client: EtcdV3Client, lease: LeaseKeeper, key_prefix: str, run_id: str,
                 secret: bytes | None) -> None:
        self._client, self._lease, self._secret = client, lease, secret
        self._dir = run_key(key_prefix, run_id, BEACONS_LEAF) + "/"
        self._beacon: Beacon | None = None
        self._own: str | None = None
        self._written: bytes | None = None  # what this agent last wrote under its key
        self._order = _ordered.Order()  # refuses an older value of a key written back (a replay)
        self._probed: dict[str, float] = {}  # node -> when its beacon last did not refuse (answered or silent)
        self._probed_stale: set[str] = set()  # of those, the ones whose heartbeat was stale at that probe
        self._revisions: dict[str, int] = {}  # node -> mod_revision of the beacon key found refusing
        self._peers: dict[str, str] = {}  # node -> beacon address, as last listed: asked during an etcd outage
        self._absent: dict[str, tuple[int, float, int]] = {}  # node -> (round, monotonic, mod_revision) first seen gone
        self._learned_round = -1
        self.reach_window_s = 3.0  # "this agent reaches etcd": it answered within this long
        self.unreachable: frozenset[str] = frozenset()  # peers whose beacon is silent from here (_partition.py)
        self.reports: dict[str, frozenset[str]] = {}  # node -> the peers it reports unreachable, as last read

    @property
    def own(self) -> str | None:
        return self._own

    def publish(self, node: str) -> None:
        """Start the beacon and write its address and host name; safe to repeat (one beacon per process)."""
        if self._beacon is None:
            spec = self._client.spec
            status = lambda: b"1" if self._client.answered_within(self.reach_window_s) else b"0"  # noqa: E731
            self._beacon = Beacon(advertised_host(spec.host, spec.port), status)
        text = f"{self._beacon.address} {socket.gethostname()}{encode(self.unreachable)}"
        self._written = _ordered.put(self._client, self._lease, "publish the agent's beacon",
                                     [(self._dir + node, text.encode())], self._secret)[0]
        self._own = node

    def learn_peers(self, round_: int, participants: Iterable[str] = ()) -> None:
        """List the beacons once per completed round (no probe): who to ask during an etcd outage. The
        round's other participants' beacons go into this agent's environment, which torchrun hands to the
        workers it starts next ($ELASTIC_MNIST_PEER_BEACONS: a late heartbeat probes them, netprobe.py)."""
        if round_ != self._learned_round:
            published = self._client.call("read the agents' beacons", lambda c: list(c.get_prefix(self._dir)))
            self._peers = {name: address for value, meta in published
                           if (name := meta.key.decode()[len(self._dir):]) != self._own
                           and (address := self._parse(meta.key.decode(), value, meta)[0])}
            self._learned_round = round_
            wanted = set(participants)
            set_peer_beacons(os.environ, {n: a for n, a in self._peers.items() if n in wanted})

    def _republish_if_changed(self, published: list) -> None:
        # Another agent took our key (a refusal it got wrong, a node back under its old name), or someone
        # wrote an older value of ours back (a replay of a report that no longer holds): without our current
        # value nobody probes us or reads our report right, so put it back. Every look does this.
        mine = [value for value, meta in published if meta.key.decode() == self._dir + (self._own or "")]
        if self._own is not None and mine != [self._written]:
            try:
                self.publish(self._own)
            except (OSError, EtcdV3Error):
                pass  # next look again

    def gone(self, nodes: Iterable[str], stale: Iterable[str] = ()) -> set[str]:
        """Of `nodes`, those whose published beacon refuses connections, and those of `stale` (no heartbeat
        for a while) whose beacon accepts without answering (a frozen agent); none without a published
        beacon, never this agent itself. Also notes who is silent from here, and reads every peer's report."""
        now, stale = time.monotonic(), set(stale)
        # A node whose heartbeat just turned stale is asked at once (is it frozen?), not RECHECK_S after
        # it last answered while it still beat.
        wanted = {n for n in nodes if n != self._own and (now - self._probed.get(n, -RECHECK_S) >= RECHECK_S
                                                           or (n in stale and n not in self._probed_stale))}
        if not wanted:
            return set()
        published = self.read_reports()
        addresses = {n: self._peers[n] for n in wanted if n in self._peers}
        for _, meta in published:
            if (name := meta.key.decode()[len(self._dir):]) in addresses:
                self._revisions[name] = meta.mod_revision
        spoke: set[str] = set()
        result = probe(addresses, read_byte=spoke)
        # No heartbeat for a while, and its host answered while its agent did not: frozen, gone without
        # waiting out the keep-alive window. Silence is never enough, however stale the heartbeat looks:
        # a partitioned node's heartbeats reach etcd late (its agent probes while holding its backend's
        # lock), and judging it dead would let each side form a round of its own. Only the shared reports
        # (_partition.py) and torch's own window decide for silent nodes.
        frozen = (result.answered - spoke) & stale
        result.refused.update(frozen)
        result.answered.difference_update(frozen)
        newly_silent = addresses.keys() - result.refused - result.answered - self.unreachable
        if newly_silent:  # a second, longer look: one slow handshake is not a partition
            again = probe({n: addresses[n] for n in newly_silent}, CONFIRM_S)
            result.refused.update(again.refused)
            result.answered.update(again.answered)
        silent = addresses.keys() - result.refused - result.answered
        for name in result.refused:
            self._probed.pop(name, None)
        self._probed.update(dict.fromkeys(addresses.keys() - result.refused, now))
        self._probed_stale = (self._probed_stale - addresses.keys()) | (addresses.keys() & stale)
        self._note_unreachable((self.unreachable & (self._peers.keys() - addresses.keys())) | silent)
        return result.refused

    def read_reports(self) -> list:
        """Every published beacon (as etcd returns them), and from them the peers' addresses and reports."""
        published = self._client.call("read the agents' beacons", lambda c: list(c.get_prefix(self._dir)))
        peers, reports = {}, {}
        for value, meta in published:
            key = meta.key.decode()
            name = key[len(self._dir):]
            address, report = self._parse(key, value, meta) if name != self._own else (None, frozenset())
            if address:
                peers[name], reports[name] = address, report
        self._peers, self.reports = peers, reports
        self._republish_if_changed(published)
        return published

    def reaches(self, nodes: Iterable[str]) -> bool:
        """Does this host reach the beacons of all `nodes` (as last listed) now? Clears them from our report
        when they answer; a node without a known beacon counts as reached (no evidence either way)."""
        addresses = {n: self._peers[n] for n in nodes if n in self._peers}
        result = probe(addresses)  # short: a silent peer is asked again on the next look
        reached = result.answered | result.refused  # a refusal comes from the peer's own kernel: its host is reachable
        self._note_unreachable(self.unreachable - reached)
        return reached >= addresses.keys()

    def _note_unreachable(self, names: Iterable[str]) -> None:
        names = frozenset(names)
        if names != self.unreachable:
            self.unreachable = names
            if self._own is not None:
                try:
                    self.publish(self._own)  # the others read it with our beacon
                except (OSError, EtcdV3Error):
                    pass  # the next look publishes it again

    def _parse(self, key: str, value: bytes, meta) -> tuple[str | None, frozenset[str]]:
        """The beacon address in a published value, if this agent can probe it meaningfully, and the
        peers its agent reports unreachable."""
        try:
            address, _, rest = self._order.open(self._secret, key, value, meta).decode().partition(" ")
        except (StateIntegrityError, UnicodeDecodeError):
            return None, frozenset()  # not written by this job, or an older value put back: no proof of anything
        host, _, report = rest.partition(" ")
        # A loopback beacon (etcd reached through 127.0.0.1, e.g. a local proxy) is only ours to probe on
        # the host that published it: elsewhere the same address is our own loopback, which would refuse.
        # Likewise an address that is also this host's own (two hosts behind NAT, docker's 172.17.0.2):
        # a probe would reach this host, whose refusal says nothing about the other one.
        if not host or host == socket.gethostname():
            return address, decode(report)
        loopback = address.startswith(("127.", "[::1]"))
        ours = self._beacon is not None and address.rpartition(":")[0] == self._beacon.address.rpartition(":")[0]
        return (None if loopback or ours else address), decode(report)

    def answering(self, nodes: Iterable[str], timeout: float = PROBE_TIMEOUT_S) -> set[str]:
        """Of `nodes` (this round's peers), those whose agent's beacon answered within `timeout`."""
        spoke: set[str] = set()
        probe({n: self._peers[n] for n in nodes if n in self._peers}, timeout, read_byte=spoke)
        return spoke

    def others_reach_etcd(self, timeout: float = PROBE_TIMEOUT_S) -> bool:
        """Does any other agent of the job (as last listed) answer that it reaches etcd? Asked while this
        one cannot: then etcd is not away, this host is cut off from it."""
        for address in list(self._peers.values()):
            try:
                host, port = split_address(address)
                with socket.create_connection((host, port), timeout=timeout) as s:
                    s.settimeout(timeout)
                    if s.recv(1) == b"1":
                        return True
            except (ValueError, OSError):
                continue  # unreachable, frozen, or an old beacon that answers nothing: no word either way
        return False

    def forget(self, node: str) -> None:
        """Remove a dead node's beacon key (it has no owner left to do it), unless it was written again since
        we probed it: an agent back under the same name (same address and pid) keeps its new key."""
        key, revision = self._dir + node, self._revisions.pop(node, None)
        if revision is None:
            return
        self._client.call("remove a dead agent's beacon", lambda c: c.transaction(
            compare=[c.transactions.mod(key) == revision], success=[c.transactions.delete(key)], failure=[]))

    def sweep_absent(self, beating: Iterable[str], round_: int, after_s: float) -> None:
        """Remove the beacon keys of nodes named in none of the job's heartbeats, unchanged over two rounds and
        `after_s` seconds: a vanished host's agent took its key nowhere and nobody got a refusal to `forget`
        it, so it would stay until its lease expires, hours later. A live agent whose key went anyway (a
        joiner that took that long to join) puts it back on its next look (_republish_if_changed)."""
        published = self._client.call("read the agents' beacons", lambda c: list(c.get_prefix(self._dir)))
        now, beating, absent = time.monotonic(), set(beating), {}
        for _, meta in published:
            if (name := meta.key.decode()[len(self._dir):]) == self._own or name in beating:
                continue
            first = self._absent.get(name)
            if first is None or first[2] != meta.mod_revision:
                absent[name] = (round_, now, meta.mod_revision)
            elif first[0] < round_ and now - first[1] >= after_s:
                self._revisions[name] = meta.mod_revision
                self.forget(name)
            else:
                absent[name] = first
        self._absent = absent

    def close(self) -> None:
        """Stop listening and take our key out (at the agent's exit; bounded by the client's settings)."""
        if self._beacon is not None:
            self._beacon.close()
        if self._own is not None:
            key, self._own = self._dir + self._own, None
            self._client.call("remove the agent's beacon", lambda c: c.delete(key))
