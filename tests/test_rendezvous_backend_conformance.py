"""torch's rendezvous-backend test suites, ported to the etcd-v3 backend against a real v3-only etcd.

    python -m pytest -q tests/test_rendezvous_backend_conformance.py

Upstream (rewritten for pytest and a real etcd, not copied):
  pytorch/pytorch test/distributed/elastic/rendezvous/rendezvous_backend_test.py
      at commit f1707950eaa95ab80f0355049b02ae2ad20f524f: RendezvousBackendTestMixin, all 9 tests.
  pytorch/pytorch test/distributed/elastic/rendezvous/dynamic_rendezvous_test.py
      at commit 584cfb1c6279fde66bea473c0adc4cbbd4ad8598: the parts that run a backend:
      BackendRendezvousStateHolderTest (sync against the backend), IntegrationTest (handlers meeting
      through the backend and store), CreateHandlerTest (settings from --rdzv-conf).

Adapted: upstream stores b"x"/b"y"/b"z"; this backend refuses anything but torch's pickled
_RendezvousState before torch unpickles it, so x/y/z are states of rounds 1/2/3. The backend tests run
twice, without and with a state secret (sealed states). Each simulated node has its own etcd
connection, as separate agents do. Upstream freezes the clock with mock.patch; here the heartbeats are
real timestamps far enough either side of the expiry bound. Where upstream expects torch's default
timeouts, etcd-v3 has the tuned defaults of elastic_mnist.contract.torchrun.RDZV_CONF.

Does not apply, and why:
  BackendRendezvousStateHolderTest cache tests (test_sync_uses_cached_state_*, *_cached_state_has_expired):
    they count backend calls under a mocked clock; that is torch's holder logic, not the backend.
  RendezvousTimeoutTest, NodeDescTest, NodeDescGeneratorTest, RendezvousStateTest, the op tests
    (_RendezvousJoinOp/ExitOp/CloseOp/KeepAliveOp), DistributedRendezvousOpExecutorTest,
    DynamicRendezvousHandlerTest and DynamicRendezvousHandlerFromBackendTest: they drive torch's own
    handler logic through fake state holders and dummy backends/stores; no backend is involved.
  test_sync_raises_error_if_backend_state_is_corrupt's message: ours names the key and the fix
    instead of torch's generic sentence; the type (RendezvousStateError) is the contract and is checked.
"""

from __future__ import annotations

import pickle
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from etcd_fixtures import raw_client, rdzv_params, wait_for_state
from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)

from elastic_mnist.contract.torchrun import RDZV_CONF
from elastic_mnist.etcd.server import EtcdServer
from elastic_mnist.rendezvous import create_backend
from elastic_mnist.rendezvous.etcd_v3 import EtcdV3RendezvousBackend, create_rdzv_handler
from elastic_mnist.rendezvous.store import EtcdV3Store

RUN_ID = "conformance"
KEEP_ALIVE = timedelta(seconds=30)  # upstream's holder settings: a node is dead after 30 s x 3


def state_bits(round_: int) -> bytes:
    state = _RendezvousState()
    state.round = round_
    return pickle.dumps(state)



@pytest.fixture
def etcd_server_v3only(etcd_v3only_wiped: EtcdServer) -> EtcdServer:
    """One etcd for the module, emptied before each test (each test's keys are its own)."""
    return etcd_v3only_wiped

@pytest.fixture(params=["unsealed", "sealed"])
def connect(request: pytest.FixtureRequest, etcd_server_v3only: EtcdServer,
            tmp_path: Path) -> Callable[[], EtcdV3RendezvousBackend]:
    """connect() -> a backend on its own etcd connection (another agent of the same job)."""
    conf = {}
    if request.param == "sealed":
        secret = tmp_path / "rdzv-secret"
        secret.write_text(secrets.token_hex(32))
        secret.chmod(0o600)
        conf["secret_file"] = str(secret)
    return lambda: create_backend(rdzv_params(etcd_server_v3only.endpoint, RUN_ID, **conf))[0]


@pytest.fixture
def backend(connect: Callable[[], EtcdV3RendezvousBackend]) -> EtcdV3RendezvousBackend:
    return connect()


def set_state(backend: EtcdV3RendezvousBackend, state: bytes, token: object = None) -> tuple:
    result = backend.set_state(state, token)  # type: ignore[arg-type]
    assert result is not None
    return result


def corrupt(server: EtcdServer, backend: EtcdV3RendezvousBackend) -> None:
    """What upstream's _corrupt_state does: bytes in the state key that no node wrote."""
    client = raw_client(server)
    try:
        client.put(backend.key, b"corrupt_state")
    finally:
        client.close()


# -- RendezvousBackendTestMixin -------------------------------------------------------------------
def test_get_state_returns_backend_state(backend: EtcdV3RendezvousBackend) -> None:
    backend.set_state(state_bits(1))
    result = backend.get_state()
    assert result is not None
    assert result[0] == state_bits(1) and result[1] is not None


def test_get_state_returns_none_if_backend_state_does_not_exist(backend: EtcdV3RendezvousBackend) -> None:
    assert backend.get_state() is None


def test_get_state_raises_error_if_backend_state_is_corrupt(backend: EtcdV3RendezvousBackend,
                                                           etcd_server_v3only: EtcdServer) -> None:
    corrupt(etcd_server_v3only, backend)
    with pytest.raises(RendezvousStateError):
        backend.get_state()


def test_set_state_sets_backend_state_if_it_does_not_exist(backend: EtcdV3RendezvousBackend) -> None:
    state, token, has_set = set_state(backend, state_bits(1))
    assert (state, has_set) == (state_bits(1), True) and token is not None


def test_set_state_sets_backend_state_if_token_is_current(backend: EtcdV3RendezvousBackend) -> None:
    _, token1, has_set1 = set_state(backend, state_bits(1))
    state2, token2, has_set2 = set_state(backend, state_bits(2), token1)
    assert state2 == state_bits(2) and token1 != token2 and has_set1 and has_set2


def test_set_state_returns_current_backend_state_if_token_is_old(backend: EtcdV3RendezvousBackend) -> None:
    _, token1, _ = set_state(backend, state_bits(1))
    state2, token2, _ = set_state(backend, state_bits(2), token1)
    state3, token3, has_set = set_state(backend, state_bits(3), token1)
    assert (state3, token3, has_set) == (state2, token2, False)


def test_set_state_returns_current_backend_state_if_token_is_none(backend: EtcdV3RendezvousBackend) -> None:
    state1, token1, _ = set_state(backend, state_bits(1))
    assert set_state(backend, state_bits(2)) == (state1, token1, False)


def test_set_state_returns_current_backend_state_if_token_is_invalid(backend: EtcdV3RendezvousBackend) -> None:
    state1, token1, _ = set_state(backend, state_bits(1))
    assert set_state(backend, state_bits(2), token="invalid") == (state1, token1, False)


# -- BackendRendezvousStateHolderTest, against the real backend -----------------------------------
def holder(backend: EtcdV3RendezvousBackend) -> _BackendRendezvousStateHolder:
    settings = RendezvousSettings(RUN_ID, 1, 1, RendezvousTimeout(), KEEP_ALIVE, 3)
    return _BackendRendezvousStateHolder(backend, settings, cache_duration=0)


def as_judged(state: _RendezvousState) -> dict:
    """A state's fields, but heartbeats by node only and no deadline: the backend shows torch those two in
    the reading agent's own clock (rendezvous/_clock.py), so their values differ from what was stored."""
    fields = dict(vars(state))
    fields["last_heartbeats"] = set(fields["last_heartbeats"])
    del fields["deadline"]
    return fields


def populated_state(now: datetime) -> _RendezvousState:
    """Upstream's _create_state: three participants and two waiting nodes, all alive."""
    state = _RendezvousState()
    state.round, state.complete, state.deadline, state.closed = 999, True, now, True
    state.participants = {_NodeDesc(f"dummy{i}", 1, 1): i - 1 for i in (1, 2, 3)}
    state.wait_list = {_NodeDesc("dummy4", 1, 1), _NodeDesc("dummy5", 1, 1)}
    # Alive: heartbeats up to 60 s old against a 90 s bound, so the test's own run time does not matter.
    state.last_heartbeats = {_NodeDesc(f"dummy{i}", 1, 1): now - timedelta(seconds=15 * (i - 1)) for i in range(1, 6)}
    return state


def test_sync_gets_empty_state_if_backend_state_does_not_exist(backend: EtcdV3RendezvousBackend) -> None:
    h = holder(backend)
    assert h.sync() is None
    assert vars(h.state) == vars(_RendezvousState())


def test_sync_gets_backend_state_if_local_state_is_clean(connect: Callable[[], EtcdV3RendezvousBackend]) -> None:
    h, other = holder(connect()), connect()
    expected, token = populated_state(datetime.now(timezone.utc)), None
    for attempt in (1, 2, 3):
        expected.round = attempt
        _, token, _ = set_state(other, pickle.dumps(expected), token)
        assert h.sync() is None
        assert as_judged(h.state) == as_judged(expected)


def test_sync_gets_backend_state_if_local_state_is_old_and_dirty(
        connect: Callable[[], EtcdV3RendezvousBackend]) -> None:
    h, other = holder(connect()), connect()
    expected, token = populated_state(datetime.now(timezone.utc)), None
    for attempt in (1, 2, 3):
        h.sync()
        expected.round = 100 + attempt
        _, token, _ = set_state(other, pickle.dumps(expected), token)  # another node writes first
        h.state.round = attempt
        h.mark_dirty()
        assert h.sync() is False
        assert as_judged(h.state) == as_judged(expected)


def test_sync_sets_backend_state_if_local_state_is_new_and_dirty(
        connect: Callable[[], EtcdV3RendezvousBackend]) -> None:
    h, other = holder(connect()), connect()
    for attempt in (1, 2, 3):
        h.state.round = attempt
        h.mark_dirty()
        assert h.sync() is True
        stored = other.get_state()
        assert stored is not None and vars(pickle.loads(stored[0])) == vars(h.state)


def test_sync_sanitizes_state(connect: Callable[[], EtcdV3RendezvousBackend]) -> None:
    h, other = holder(connect()), connect()
    now = datetime.now(timezone.utc)
    state, expected = populated_state(now), populated_state(now)
    dead = [_NodeDesc(f"dead{i}", 1, 1) for i in range(1, 6)]
    for i, node in enumerate(dead):
        state.last_heartbeats[node] = now - timedelta(seconds=100 + 10 * i)  # past 30 s x 3
    state.participants.update(dict.fromkeys(dead[:3], 0))
    state.wait_list.update(dead[3:])
    set_state(other, pickle.dumps(state))
    h.sync()
    assert as_judged(h.state) == as_judged(expected)


def test_sync_sanitizes_state_if_no_participants_is_left(connect: Callable[[], EtcdV3RendezvousBackend]) -> None:
    h, other = holder(connect()), connect()
    now = datetime.now(timezone.utc)
    state = populated_state(now)
    state.last_heartbeats = {node: now - timedelta(seconds=100) for node in state.last_heartbeats}
    set_state(other, pickle.dumps(state))
    h.sync()
    assert (h.state.complete, h.state.round, h.state.participants, h.state.wait_list, h.state.last_heartbeats) \
        == (False, 1000, {}, set(), {})


def test_sync_raises_error_if_backend_state_is_corrupt(backend: EtcdV3RendezvousBackend,
                                                      etcd_server_v3only: EtcdServer) -> None:
    corrupt(etcd_server_v3only, backend)
    with pytest.raises(RendezvousStateError):
        holder(backend).sync()


# -- CreateHandlerTest and IntegrationTest, through our torchrun entry point ----------------------
class Nodes:
    """Handlers as torchrun builds them for --rdzv-backend=etcd-v3, each on its own etcd connection;
    node i has local address address_i, as upstream's IntegrationTest names them."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint, self.handlers = endpoint, []
        self.pool = ThreadPoolExecutor(4)

    def add(self, min_nodes: int = 2, max_nodes: int = 2, **conf: object) -> DynamicRendezvousHandler:
        params = RendezvousParameters("etcd-v3", self.endpoint, RUN_ID, min_nodes, max_nodes,
                                      local_addr=f"address_{len(self.handlers)}",
                                      **{"join_timeout": 60, "warm_start": 0, **conf})  # no workers: no warm process
        self.handlers.append(create_rdzv_handler(params))
        return self.handlers[-1]

    def join(self, handlers: list[DynamicRendezvousHandler]) -> list[RendezvousInfo]:
        futures = [self.pool.submit(h.next_rendezvous) for h in handlers]
        return [f.result(timeout=120) for f in futures]

    def close(self) -> None:
        """Closing the rendezvous ends every node still waiting in next_rendezvous (a redundant node
        never times out); then no heartbeat thread may outlive the test."""
        if self.handlers:
            self.handlers[0].shutdown()
        for handler in self.handlers:
            handler._stop_heartbeats()
        self.pool.shutdown(wait=True)


@pytest.fixture
def nodes(etcd_server_v3only: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Nodes]:
    # What create_rdzv_handler sets for a real agent; set here so the test process gets it back after.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    group = Nodes(etcd_server_v3only.endpoint)
    yield group
    group.close()


def test_create_handler_returns_handler(nodes: Nodes) -> None:
    handler = nodes.add(3, 6, join_timeout="50", last_call_timeout="60", close_timeout="70")
    defaults = nodes.add(3, 6)
    assert (handler.get_backend(), handler.get_run_id()) == ("etcd-v3", RUN_ID)
    assert (handler.settings.min_nodes, handler.settings.max_nodes) == (3, 6)
    timeout = handler.settings.timeout
    assert (timeout.join, timeout.last_call, timeout.close) == tuple(timedelta(seconds=s) for s in (50, 60, 70))
    # Upstream expects torch's defaults for what is not given; etcd-v3 fills in the tuned ones first.
    tuned = RDZV_CONF["etcd-v3"]
    assert defaults.settings.timeout.last_call == timedelta(seconds=tuned["last_call_timeout"])
    assert defaults.settings.keep_alive_interval == timedelta(seconds=tuned["keep_alive_interval"])
    assert defaults.settings.timeout.close == RendezvousTimeout().close, "not tuned: torch's default"


def test_all_nodes_join_rendezvous(nodes: Nodes, etcd_server_v3only: EtcdServer) -> None:
    infos = nodes.join([nodes.add(), nodes.add()])
    ranks = [i.rank for i in infos]
    assert sorted(ranks) == [0, 1] and {i.world_size for i in infos} == {2}
    for info in infos:
        assert isinstance(info.store, PrefixStore) and isinstance(info.store.underlying_store, EtcdV3Store)
    # Rank 0 published its address through our store; the other node read it over its own connection.
    assert {i.bootstrap_store_info.master_addr for i in infos} == {f"address_{ranks.index(0)}"}
    state = wait_for_state(etcd_server_v3only, RUN_ID, lambda s: s.complete)
    infos[0].store.set("dummy_key", "v")
    client = raw_client(etcd_server_v3only)
    try:  # torch's per-round prefix, inside our per-job store prefix
        key = f"{infos[0].store.underlying_store.prefix}torch.rendezvous.{RUN_ID}.{state.round}/dummy_key"
        assert client.get(key)[0] == b"v"
    finally:
        client.close()
    assert nodes.handlers[0].shutdown() is True
    assert wait_for_state(etcd_server_v3only, RUN_ID, lambda s: s.closed).closed


@pytest.mark.slow
def test_redundancy_list(nodes: Nodes, etcd_server_v3only: EtcdServer) -> None:
    handlers = [nodes.add(), nodes.add(), nodes.add()]
    nodes.join(handlers[:2])
    third = nodes.pool.submit(handlers[2].next_rendezvous)
    state = wait_for_state(etcd_server_v3only, RUN_ID, lambda s: s.redundancy_list)
    assert [node.addr for node in state.redundancy_list] == ["address_2"]
    handlers[0].shutdown()
    with pytest.raises(RendezvousGracefulExitError):  # torch's word for a redundant node on close
        third.result(timeout=60)


@pytest.mark.slow
def test_redundancy_transition_to_wait_list_then_join_rendezvous(nodes: Nodes,
                                                                 etcd_server_v3only: EtcdServer) -> None:
    # A node is dead after 1 s x 2 without a heartbeat; the last call is long so max_nodes completes it.
    fast = {"keep_alive_interval": 1, "keep_alive_max_attempt": 2, "last_call_timeout": 60}
    handlers = [nodes.add(1, 2, **fast) for _ in range(3)]
    nodes.join(handlers[:2])
    third = nodes.pool.submit(handlers[2].next_rendezvous)
    wait_for_state(etcd_server_v3only, RUN_ID, lambda s: s.redundancy_list)
    handlers[1]._stop_heartbeats()  # node 1 dies silently, as upstream simulates it
    state = wait_for_state(etcd_server_v3only, RUN_ID, lambda s: len(s.participants) == 1 and len(s.wait_list) == 1)
    assert [n.addr for n in state.wait_list] == ["address_2"] and not state.redundancy_list
    handlers[0].shutdown()
    with pytest.raises(RendezvousClosedError):  # a waiting node, no longer a redundant one
        third.result(timeout=60)
