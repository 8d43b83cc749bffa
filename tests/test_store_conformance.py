"""torch's own c10d Store test suite, ported to the etcd-v3 store against a real v3-only etcd.

    python -m pytest -q tests/test_store_conformance.py

Upstream: pytorch/pytorch test/distributed/test_store.py at commit f34fa1515024423a239ce26f33a8b65ea9252502
(torch 2.14-era: StoreTestBase with check, append, multi_get/multi_set, queues and clone). Rewritten
for pytest, not copied. Every StoreTestBase test runs twice: on the Python store itself and through
torch's C++ PrefixStore, which is what torchrun's agent hands around and which reaches our store
through pybind's trampoline (C++ names like getNumKeys/deleteKey, Python names like compare_set).

Ported (upstream name -> here):
  StoreTestBase.test_set_get_check / test_compare_set / test_simple_wait / test_append /
  test_multi_set / test_multi_get / test_clone              -> the same names below
  StoreTestBase.test_queues*                                -> test_queues_are_not_supported
  TCPStoreTest.test_numkeys_delkeys                         -> test_numkeys_delkeys (no init key here)
  TCPStoreTest._multi_worker_helper                         -> test_multi_worker_on_separate_connections
  TestMultiThreadedWait._test_wait                          -> test_wait_for_a_key_set_by_another_connection
  TimeoutTest.test_interrupt_doesnt_break_wait              -> test_a_signal_does_not_break_wait
  RendezvousTCPTest.test_tcp_store_timeout_set / _doest_break_client -> test_get_honours_a_short_timeout...
  PrefixStoreTest.test_get_underlying_store, PrefixTCPStoreTest.test_underlying_non_prefix_store
                                                            -> test_prefix_store_unwraps_to_our_store
  PythonStoreTest.test_set_get (dist._test_python_store)    -> test_cpp_driven_set_get
  TestPythonStore.test_*_roundtrip                          -> test_extended_api_round_trips_through_prefix_store
Added: Store.barrier (new in torch's Store API; its default is add/set/wait through the trampoline)
and a gloo process group bootstrapped over the store, the store's real consumer.

Does not apply, and why:
  queue_push/queue_pop/queue_len: only TCPStore implements queues; torch's trampoline does not
    dispatch them to Python, so no Python store can offer them (upstream skips such stores).
  list_keys: likewise never dispatched to a Python store by torch's trampoline.
  TCPStore-only tests (address in use, multi-tenancy, repr, libuv, listen-fd take-over, world size 0,
    missing clients on start, agent store, wire protocol), FileStore refcounting, and the file://,
    tcp:// and env:// rendezvous URL tests: about other stores' transports, not the Store contract.
  TestPythonStore.test_optional_methods_fail / test_extended_methods_fallbacks: about a Python store
    WITHOUT append/multi_get/multi_set; ours implements them natively (has_extended_api() is True).
  num_keys_total: TCPStore counts one extra coordination key; this store has none, so 5 (the base case).
"""

from __future__ import annotations

import gc
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from etcd_fixtures import raw_client, rdzv_params
from torch.distributed import DistStoreError

from elastic_mnist.etcd.server import EtcdServer
from elastic_mnist.procs import wait_for
from elastic_mnist.rendezvous import create_backend

VIEWS = ["etcd-v3-store", "prefix-store"]
RUN_ID = "conformance"



@pytest.fixture
def etcd_server_v3only(etcd_v3only_wiped: EtcdServer) -> EtcdServer:
    """One etcd for the module, emptied before each test (each test's keys are its own)."""
    return etcd_v3only_wiped

@pytest.fixture
def connect(etcd_server_v3only: EtcdServer) -> Iterator[Callable[..., dist.Store]]:
    """connect(view) -> a store on its own etcd connection, as another agent would have; all of one
    test's connections share the job's keys."""
    keep: list[dist.Store] = []  # a PrefixStore does not keep the Python store under it alive

    def connect(view: str = VIEWS[0]) -> dist.Store:
        _, store = create_backend(rdzv_params(etcd_server_v3only.endpoint, RUN_ID))
        store.set_timeout(timedelta(seconds=300))
        keep.append(store)
        return dist.PrefixStore("test_prefix", store) if view == "prefix-store" else store

    yield connect
    keep.clear()


@pytest.fixture(params=VIEWS)
def store(request: pytest.FixtureRequest, connect: Callable[..., dist.Store]) -> dist.Store:
    return connect(request.param)


def watchers(server: EtcdServer) -> int:
    """etcd's own count of open watches: a reader blocked in get/wait holds exactly one."""
    text = urllib.request.urlopen(f"http://{server.endpoint}/metrics", timeout=10).read().decode()
    return int(float(next(line.split()[1] for line in text.splitlines()
                          if line.startswith("etcd_debugging_mvcc_watcher_total "))))


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    """Run fn in a thread; the dict gets 'result' or 'error'."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test, which asserts on it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# -- StoreTestBase --------------------------------------------------------------------------------
def test_set_get_check(store: dist.Store) -> None:
    for n in (1, 2, 3):
        store.add("key", n)
    store.set("key0", "value0")
    store.add("key3", 1)
    store.set("key1", "value1")
    store.add("key3", 2)
    store.set("key2", "value2")
    for n in (3, 4, 5, 6):
        store.add("key3", n)
    assert store.num_keys() == 5
    assert [store.get(k) for k in ("key", "key0", "key1", "key2", "key3")] == [
        b"6", b"value0", b"value1", b"value2", b"21"]
    assert store.check(["key3"]) and not store.check(["Randomkey3"])
    store.set("-key3", "7")
    assert store.get("-key3") == b"7"
    assert store.delete_key("-key3") is True
    assert store.num_keys() == 5


def test_compare_set(store: dist.Store) -> None:
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"
    assert not store.check(["cs_key0"]), "a failed compare_set on a missing key creates nothing"
    store.set("cs_key0", "value0")
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
    assert store.get("cs_key0") == b"value0"
    assert store.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
    assert store.get("cs_key0") == b"new_value0"
    assert store.compare_set("cs_key1", "", "new_value1") == b"new_value1"
    assert store.get("cs_key1") == b"new_value1"


def test_simple_wait(store: dist.Store) -> None:
    started = time.monotonic()
    with pytest.raises(DistStoreError, match="[t -i]imeout"):  # upstream: RuntimeError; DistStoreError is one
        store.wait(["bad_key"], timedelta(seconds=0.25))
    assert time.monotonic() - started < 10, "the wait's own timeout, not the store's 300 s"
    store.add("good_key", 1)
    store.wait(["good_key"])


def test_append(store: dist.Store) -> None:
    assert store.has_extended_api()
    store.set("foo", "po")
    store.append("foo", "tato")
    store.append("bar", "po")
    store.append("bar", "tato")
    assert (store.get("foo"), store.get("bar")) == (b"potato", b"potato")


def test_multi_set(store: dist.Store) -> None:
    store.multi_set(["foo", "bar"], ["po", "tato"])
    assert (store.get("foo"), store.get("bar")) == (b"po", b"tato")


def test_multi_get(store: dist.Store) -> None:
    store.set("foo", "po")
    store.set("bar", "tato")
    assert store.multi_get(["foo", "bar"]) == [b"po", b"tato"]


def test_clone(store: dist.Store) -> None:
    clone = store.clone()
    assert isinstance(clone, dist.Store)
    gc.collect()  # a clone handed to C++ only must keep its Python methods
    store.set("foo", "bar")
    assert clone.get("foo") == b"bar"
    thread, out = in_thread(lambda: clone.add("from_thread", 2))  # the point of a clone
    thread.join(60)
    assert out == {"result": 2} and store.get("from_thread") == b"2"


def test_queues_are_not_supported(store: dist.Store) -> None:
    with pytest.raises(NotImplementedError, match="queue"):
        store.queue_push("test_queue_support", "1")


# -- TCPStoreTest, TestMultiThreadedWait, TimeoutTest, RendezvousTCPTest ----------------------------
def test_numkeys_delkeys(store: dist.Store) -> None:
    assert store.num_keys() == 0
    for n in (1, 2, 3):
        store.add("key", n)
    store.set("key0", "value0")
    store.add("key3", 1)
    store.set("key1", "value1")
    assert store.num_keys() == 4
    assert store.delete_key("key") and not store.delete_key("key")
    assert store.num_keys() == 3
    store.set_timeout(timedelta(seconds=0.5))
    with pytest.raises(RuntimeError, match="Timeout"):
        store.get("key")
    store.delete_key("key0")
    store.delete_key("key3")
    assert store.num_keys() == 1
    store.set("key4", "value2")
    assert store.num_keys() == 2
    assert (store.get("key1"), store.get("key4")) == (b"value1", b"value2")


@pytest.mark.parametrize("view", VIEWS)
def test_multi_worker_on_separate_connections(connect: Callable[..., dist.Store], view: str) -> None:
    server = connect(view)
    server.set("key", "value")
    for i in range(5):
        client = connect(view)
        assert client.get("key") == b"value"
        client.set(f"new_key{i}", f"new_value{i}")
        assert client.compare_set(f"new_key{i}", f"new_value{i}", f"next_value{i}") == f"next_value{i}".encode()
    assert server.get("new_key4") == b"next_value4"


@pytest.mark.parametrize("view", VIEWS)
def test_wait_for_a_key_set_by_another_connection(connect: Callable[..., dist.Store], view: str,
                                                  etcd_server_v3only: EtcdServer) -> None:
    waiter, setter = connect(view), connect(view)
    waiter.set_timeout(timedelta(seconds=60))
    thread, out = in_thread(lambda: (waiter.wait(["key1"]), waiter.get("key1"))[1])
    wait_for(lambda: watchers(etcd_server_v3only) >= 1, 30, "the waiter to block on an etcd watch")
    assert thread.is_alive() and not out
    setter.set("key1", "value1")
    thread.join(60)
    assert out == {"result": b"value1"}


def test_a_signal_does_not_break_wait(connect: Callable[..., dist.Store], etcd_server_v3only: EtcdServer) -> None:
    waiter, setter = connect(), connect()
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        thread, out = in_thread(lambda: waiter.wait(["foo"], timedelta(seconds=60)))
        wait_for(lambda: watchers(etcd_server_v3only) >= 1, 30, "the waiter to block on an etcd watch")
        signal.pthread_kill(thread.ident, signal.SIGUSR1)  # type: ignore[arg-type]
        setter.set("foo", "bar")
        thread.join(60)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert out == {"result": None}


def test_get_honours_a_short_timeout_and_the_store_still_works(store: dist.Store) -> None:
    store.set_timeout(timedelta(seconds=0.1))
    started = time.monotonic()
    with pytest.raises(DistStoreError, match=r"Timeout waiting for key.*the_key.* after 100 ms"):
        store.get("the_key")
    assert time.monotonic() - started < 10
    store.set("the_key", "x")
    assert store.get("the_key") == b"x"


# -- PrefixStore, the C++ trampoline, and the Store API's newer calls -------------------------------
def test_prefix_store_unwraps_to_our_store(connect: Callable[..., dist.Store]) -> None:
    ours = connect()
    prefixed = dist.PrefixStore("prefix", ours)
    assert prefixed.underlying_store is ours
    nested = dist.PrefixStore("prefix", prefixed)
    assert nested._underlying_non_prefix_store is ours


def test_cpp_driven_set_get(connect: Callable[..., dist.Store]) -> None:
    ours = connect()
    dist._test_python_store(ours)  # torch's C++ test body: set/get/add/... through the trampoline
    assert ours.num_keys() > 0


def test_extended_api_round_trips_through_prefix_store(connect: Callable[..., dist.Store],
                                                       etcd_server_v3only: EtcdServer) -> None:
    ours = connect()
    prefixed = dist.PrefixStore("p", ours)
    assert prefixed.has_extended_api()
    prefixed.append("foo", "bar")
    prefixed.multi_set(["a", "b"], [b"x", b"y"])
    assert prefixed.multi_get(["a", "b", "foo"]) == [b"x", b"y", b"bar"]
    client = raw_client(etcd_server_v3only)
    try:
        assert client.get(f"{ours.prefix}p/foo")[0] == b"bar", "PrefixStore prefixes the keys it hands us"
        assert client.get(f"{ours.prefix}p/b")[0] == b"y"
    finally:
        client.close()


@pytest.mark.parametrize("view", VIEWS)
def test_barrier_releases_all_members_and_times_out_alone(connect: Callable[..., dist.Store], view: str) -> None:
    members = [connect(view) for _ in range(2)]
    threads = [in_thread(lambda s=s: s.barrier("all", 2, timedelta(seconds=60))) for s in members]
    for thread, _ in threads:
        thread.join(60)
    assert [out for _, out in threads] == [{"result": None}] * 2
    with pytest.raises(DistStoreError, match="Timeout"):
        members[0].barrier("alone", 2, timedelta(seconds=0.5))


def test_gloo_process_group_bootstraps_over_the_store(connect: Callable[..., dist.Store]) -> None:
    stores = [dist.PrefixStore("gloo", connect()) for _ in range(2)]
    sums: list[float] = [0.0, 0.0]

    def rank(r: int) -> None:
        group = dist.ProcessGroupGloo(stores[r], r, 2, timedelta(seconds=60))
        tensor = torch.tensor([r + 1.0])
        group.allreduce([tensor]).wait()
        sums[r] = tensor.item()

    threads = [in_thread(lambda r=r: rank(r)) for r in range(2)]
    for thread, _ in threads:
        thread.join(120)
    assert [out for _, out in threads] == [{"result": None}] * 2
    assert sums == [3.0, 3.0]
