"""Native etcd v3 rendezvous for torchrun, `--rdzv-backend=etcd-v3`: no v2 API needed.

    elastic-mnist etcd --no-v2 --port 2379
    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 \\
        --rdzv-id=job1 --rdzv-conf=join_timeout=300,keep_alive_interval=5 -m elastic_mnist.train ...

The protocol is torch's own DynamicRendezvousHandler (as for its etcd-v2 and c10d backends): the whole
rendezvous state (round, participants, heartbeats) is one pickled `_RendezvousState` in the key
`{key_prefix}/{run_id}/state`, written by an etcd transaction that compares the key's mod_revision
(the fencing token), so exactly one writer wins per token. Different run ids never share a key, so a
crashed job cannot block a new one; a reused run id recovers once the dead nodes' heartbeats age out
(keep_alive_interval x keep_alive_max_attempt, 3 s by default). A torchrun on a closed rendezvous exits
at once with one line: 0 if the job finished, 78 if a node gave up (_closed.py).

Bounds: every etcd call has a deadline of read_timeout (10 s by default), and the handler probes etcd
when torchrun creates it, so an unreachable etcd is ONE error naming the endpoint within 10 s. Once etcd
answered, an outage is ridden out for up to outage_timeout (etcd/client.py), unless a peer's beacon says it
still reaches etcd (then this host is cut off and leaves as before); heartbeats are aged on each
observer's own clock and nobody is judged for the outage (_clock.py).

Shortcuts on top of torch's protocol, from the backend side (_prompt.py): a round whose participants are
every live node completes without the last call; nobody sleeps a blind second between looks at the state
(an etcd watch wakes them); a SIGKILLed node whose agent port refuses connections is dropped at once
(_liveness.py, `peer_probe`); an agent that exits while the job goes on (SIGTERM) takes itself out of
the state (_leave.py). Only a frozen node, or one whose host vanished, costs the heartbeat window.

--rdzv-conf keys (contract/rdzv_conf.py's SCHEMA, shared with preflight and status; any other is refused by name):
  join_timeout=600 last_call_timeout=1 close_timeout=30 heartbeat_timeout=5    torch's handler, seconds
  keep_alive_interval=1 keep_alive_max_attempt=3      torch's handler; tuned: contract/torchrun.py's RDZV_CONF
  read_timeout=10 (each etcd call's deadline, s)  key_prefix=/torchelastic/v3  lease_ttl=7200 (0: never; etcd/lease.py)
  outage_timeout=360   how long a running agent waits for an etcd that answered it before (s)
  peer_probe=1         drop a killed node when its agent's port refuses connections (0: off; _liveness.py)
  warm_start=1         workers start as forks of a warm process that imported torch once (0: cold; warm/)
  crash_limit=10 crash_window=3600   this node's own worker failures it survives within the window (_budget.py)
  protocol=http|https  cacert=PATH  cert=PATH  key=PATH
  user=NAME  password_file=PATH  etcd credentials (else $ELASTIC_MNIST_ETCD_USER, $..._PASSWORD_FILE); password=
  secret_file=PATH     HMAC key every node shares (else $ELASTIC_MNIST_RDZV_SECRET_FILE): see etcd/rdzv_state.py
  timeout              added by torchrun itself (--rdzv-timeout); ignored, as torch's dynamic backends do

State read from etcd is checked before torch unpickles it (etcd/rdzv_state.py): a restricted unpickler always; with
secret_file an HMAC, and that it is not an older state written back (_replay.py); a refused state is ONE
error. secret_file seals the Store's values too (store.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token, create_handler

from elastic_mnist import agent_link, job_secret
from elastic_mnist.compat import private as compat
from elastic_mnist.contract.env import set_agent_pid
from elastic_mnist.contract.errors import UserError
from elastic_mnist.contract.keys import STATE_LEAF, STORE_LEAF
from elastic_mnist.contract.rdzv_conf import (
    BACKEND_NAME,
    DEFAULT_KEY_PREFIX,
    SCHEMA,
    VALID_KEYS,
    EtcdV3ConfigError,
)
from elastic_mnist.contract.torchrun import RDZV_CONF
from elastic_mnist.etcd.client import EtcdV3Client, EtcdV3Error, run_key
from elastic_mnist.etcd.lease import LeaseKeeper
from elastic_mnist.etcd.rdzv_state import ALLOWED_CLASSES, StateIntegrityError, decode_state, seal_state, unseal_state
from elastic_mnist.rendezvous._budget import count_only_own_failures
from elastic_mnist.rendezvous._closed import exit_if_closed
from elastic_mnist.rendezvous._early import before_joining
from elastic_mnist.rendezvous._flags import keep_the_job_flags
from elastic_mnist.rendezvous._leave import leave, leave_at_exit
from elastic_mnist.rendezvous._liveness import PeerLiveness
from elastic_mnist.rendezvous._prompt import RoundView, make_prompt
from elastic_mnist.rendezvous._replay import ReplayGuard
from elastic_mnist.rendezvous._settings import EtcdV3Settings, parse_settings
from elastic_mnist.rendezvous._shrink import restart_when_the_round_shrinks
from elastic_mnist.rendezvous._sweep import sweep_finished_rounds
from elastic_mnist.rendezvous._verdict import end_the_job_on_config_errors
from elastic_mnist.rendezvous.policy import AgentPolicy
from elastic_mnist.rendezvous.store import EtcdV3Store

# The --rdzv-conf schema (keys, defaults, secrets) is contract/rdzv_conf.py's; re-exported for existing importers.
__all__ = ["SCHEMA", "VALID_KEYS", "EtcdV3ConfigError", "EtcdV3ConnectionError", "EtcdV3RendezvousBackend",
           "EtcdV3Settings", "EtcdV3StateError", "create_backend", "create_rdzv_handler", "parse_settings",
           "with_tuned_defaults"]
# torch unpickles what this backend returns: the classes our unpickler admits must still be torch's.
compat.check_pickled_classes(ALLOWED_CLASSES)


class EtcdV3ConnectionError(RendezvousConnectionError, EtcdV3Error):
    """etcd could not be used; a RendezvousConnectionError so torch's handler treats it as such."""


class EtcdV3StateError(RendezvousStateError, StateIntegrityError):
    """The state key holds bytes this job did not write; a RendezvousStateError for torch's handler."""


_reported: set[str] = set()


def report(exc: BaseException) -> None:
    """Print the error as one line on stderr, once per process: under torchrun it is then the first thing
    a user sees, ahead of torch's long traceback, which ends with the same message."""
    line = f"elastic-mnist {BACKEND_NAME}: error: {exc}"
    if line not in _reported:
        _reported.add(line)
        print(line, file=sys.stderr, flush=True)


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Holds the dynamic rendezvous state in one etcd key; the token is the key's mod_revision.
    Every state read is checked (`unseal_state`) before torch sees it; with a secret, every write is sealed
    with its lineage and every read must be where etcd holds it (`ReplayGuard`).
    `view` (a RoundView) then adjusts what torch sees; `revision` is the last one read, for watches."""

    def __init__(self, client: EtcdV3Client, run_id: str, key_prefix: str = DEFAULT_KEY_PREFIX,
                 lease: LeaseKeeper | None = None, secret: bytes | None = None,
                 view: RoundView | None = None) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._client = client
        self._view = view
        self._lease = lease or LeaseKeeper(client, 0)
        self._secret = secret
        self._guard, self._lock = ReplayGuard(), threading.Lock()
        self.key = run_key(key_prefix, run_id, STATE_LEAF)
        self.revision = 0

    def _checked(self, stored: bytes, meta: Any) -> bytes:
        """`meta`: etcd's metadata of the key as read (mod/create revision, version)."""
        try:
            state_bits, lineage = unseal_state(self._secret, self.key, stored)
            if self._secret is not None:  # without a secret anyone may write the key: nothing to compare
                self._guard.admit(self.key, lineage, meta)
        except StateIntegrityError as exc:
            error = EtcdV3StateError(str(exc))
            report(error)
            raise error from None
        self.revision = max(self.revision, int(meta.mod_revision))
        return state_bits if self._view is None else self._view(state_bits)

    @property
    def view(self) -> RoundView | None:
        return self._view

    @property
    def liveness(self) -> PeerLiveness | None:
        """The beacon probe of this agent (None with peer_probe=0)."""
        return None if self._view is None else self._view.liveness

    def wait_for_change(self, seconds: float) -> bool:
        """Block until the state key is written after the last revision we read, or `seconds` pass."""
        if self.revision:
            try:
                return self._client.wait_for_change(self.key, self.revision, seconds)
            except EtcdV3Error:  # cannot even connect: torch's next look at the state reports it properly
                pass
        time.sleep(seconds)  # nothing to watch from yet, or no connection: torch's own pause
        return False

    @property
    def name(self) -> str:
        return BACKEND_NAME

    @property
    def client(self) -> EtcdV3Client:
        return self._client

    def get_state(self) -> tuple[bytes, Token] | None:
        with self._lock:  # one read or write at a time: the replay guard sees etcd's history in order
            return self._get_state()

    def _get_state(self) -> tuple[bytes, Token] | None:
        resp = self._client.call("read the rendezvous state", lambda c: c.get_response(self.key))
        if not resp.kvs:
            self._guard.found_absent(int(resp.header.revision))  # the floor of a state that creates the key
            return None
        return self._checked(resp.kvs[0].value, resp.kvs[0]), int(resp.kvs[0].mod_revision)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        with self._lock:
            return self._set_state(state, token)

    def _set_state(self, state: bytes, token: Token | None) -> tuple[bytes, Token, bool] | None:
        if token and not isinstance(token, int):
            current = self._get_state()  # a token we never issued cannot match; report the real state
            return None if current is None else (*current, False)

        def txn(c: Any, lease: int | None) -> tuple[bool, list[Any]]:
            t = c.transactions
            # No token: create only if absent (torch's contract); else only if nobody wrote since `token`.
            guard = t.create(self.key) == 0 if not token else t.mod(self.key) == token
            return c.transaction(compare=[guard], success=[t.put(self.key, stored, lease=lease), t.get(self.key)],
                                 failure=[t.get(self.key)])

        if self._view is not None:
            state = self._view.restore(state)
        stored = seal_state(self._secret, self.key, state, self._guard.successor(token))
        succeeded, responses = self._lease.run("write the rendezvous state", txn)
        kvs = responses[-1]  # the Get's [(value, KVMetadata)]: the state as of this transaction
        if not kvs:
            return None
        value, meta = kvs[0]
        return self._checked(value, meta), int(meta.mod_revision), bool(succeeded)


def _joins_a_running_job(state: tuple[bytes, Any] | None, fresh_s: float = 30.0) -> bool:
    """A complete, open round one of whose participants beat within `fresh_s` (by its own clock and ours:
    a clock far off only costs this node's import running before its join or beside it)."""
    if state is None:
        return False
    try:
        round_ = decode_state(state[0])
    except Exception:  # noqa: BLE001 - unreadable here is refused by the handler itself, with its message
        return False
    now = datetime.now(timezone.utc)
    return round_.complete and not round_.closed and any(
        abs((now - beat).total_seconds()) < fresh_s
        for node, beat in round_.last_heartbeats.items() if node in round_.participants)


def with_tuned_defaults(params: RendezvousParameters) -> RendezvousParameters:
    """A copy of params where every key of RDZV_CONF["etcd-v3"] that the user did not give is filled in."""
    config = {**RDZV_CONF[BACKEND_NAME], **params.config}
    return RendezvousParameters(params.backend, params.endpoint, params.run_id, params.min_nodes, params.max_nodes,
                                params.local_addr, **config)


def create_backend(params: RendezvousParameters) -> tuple[EtcdV3RendezvousBackend, Store]:
    """Backend + Store sharing one connection and lease; probes etcd so a bad endpoint fails here."""
    settings = parse_settings(params)
    client = EtcdV3Client(settings.connection, error_type=EtcdV3ConnectionError)
    lease = LeaseKeeper(client, settings.lease_ttl)
    liveness = PeerLiveness(client, lease, settings.key_prefix, params.run_id, settings.secret) \
        if settings.peer_probe else None
    if liveness is not None:  # in an etcd outage, the peers' beacons tell "etcd away" from "we are cut off"
        liveness.reach_window_s = settings.window.total_seconds()
        client.others_reach_etcd = liveness.others_reach_etcd
    backend = EtcdV3RendezvousBackend(client, params.run_id, settings.key_prefix, lease, settings.secret,
                                      RoundView(settings.window, liveness, settings.last_call))
    store = EtcdV3Store(client, run_key(settings.key_prefix, params.run_id, STORE_LEAF), lease=lease,
                        secret=settings.secret)
    try:
        backend.get_state()  # reachability, TLS, credentials and read permission in one round trip
    except BaseException:
        client.close()
        raise
    return backend, store


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """What torchrun calls for --rdzv-backend=etcd-v3: torch's dynamic handler over our backend.
    Timeouts and keep-alive settings are read from params by torch's create_handler itself."""
    params = with_tuned_defaults(params)
    try:
        settings = parse_settings(params)
        backend, store = create_backend(params)
    except UserError as exc:
        report(exc)
        raise
    state = backend.get_state()
    exit_if_closed(params.run_id, state, store, f"elastic-mnist {BACKEND_NAME}")  # nothing started yet
    compat.fresh_worker_store(os.environ)  # in the agent process that chose our backend; see compat/private.py
    set_agent_pid(os.environ, os.getpid())  # its workers' parent (it may be PID 1: procs.py)
    agent_dir = agent_link.create(os.environ)  # private: the warm socket, a worker's configuration error
    job_secret.hand_to_workers(params.get("secret_file"))  # their checkpoints' digest key
    flags = before_joining(agent_dir, settings, _joins_a_running_job(state), store, params.run_id)
    compat.quick_event_names()  # 0.8 s of a rendezvous's CPU on 2 cores: see compat/private.py
    handler = create_handler(store, backend, params)
    make_prompt(handler, backend)
    policy = AgentPolicy(handler)  # the layers in policy.py's ORDER
    if backend.view is not None:  # always, as create_backend builds it
        policy.add("shrink", restart_when_the_round_shrinks(backend.view, store))
        policy.add("sweep", sweep_finished_rounds(backend.view, store, params.run_id))
        policy.add("verdict", end_the_job_on_config_errors(backend.view, store, params.run_id, agent_dir,
                                                           backend.get_state))
    if flags is not None:
        policy.add("flags", keep_the_job_flags(store, flags))
    policy.add("budget", count_only_own_failures(agent_dir, settings.crash_limit, settings.crash_window,
                                                 lambda: leave(handler, backend.client, backend.liveness)))
    policy.install()
    if backend.liveness is not None:
        try:
            backend.liveness.publish(str(compat.handler_node(handler)))
        except OSError as exc:  # no route or address for a beacon: probing others still works
            print(f"elastic-mnist {BACKEND_NAME}: warning: no beacon for this agent ({exc}); others drop it "
                  "after the keep-alive window if it is killed (peer_probe=0 turns probing off)", file=sys.stderr)
    leave_at_exit(handler, backend.client, backend.liveness)
    return handler
