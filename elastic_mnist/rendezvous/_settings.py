"""`--rdzv-conf` of `--rdzv-backend=etcd-v3` as the backend uses it: every value checked before any RPC.

    python -m pytest tests/test_rendezvous_etcd_v3.py -q -k rejected   # every bad value: one line naming it

The keys themselves (names, defaults, who reads them) are contract/rdzv_conf.py's SCHEMA; this turns one job's values
into `EtcdV3Settings`, with one error line naming the key for each bad one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic_mnist.contract.keys import STATE_LEAF
from elastic_mnist.contract.rdzv_conf import (
    DEFAULT_CRASH_LIMIT,
    DEFAULT_CRASH_WINDOW_S,
    DEFAULT_KEY_PREFIX,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_OUTAGE_TIMEOUT_S,
    EtcdV3ConfigError,
    check_keys,
    check_values,
)
from elastic_mnist.etcd.client import EtcdConnectionSpec, EtcdV3Error, run_key
from elastic_mnist.etcd.secrets import connection_spec, secret


@dataclass(frozen=True)
class EtcdV3Settings:
    connection: EtcdConnectionSpec
    key_prefix: str
    lease_ttl: int
    secret: bytes | None = None
    peer_probe: bool = True
    window: timedelta = timedelta(seconds=3)
    """keep_alive_interval x keep_alive_max_attempt: how long a silent node stays in the rendezvous."""
    last_call: timedelta = timedelta(seconds=1)
    warm_start: bool = True
    """Workers start as forks of a warm process beside the agent (elastic_mnist/warm)."""
    in_place: bool = True
    """Workers outlive their round: a membership change rebuilds only their process groups (warm/kept.py)."""
    crash_limit: int = DEFAULT_CRASH_LIMIT
    """How many of this node's own worker failures within crash_window it survives (_budget.py)."""
    crash_window: float = DEFAULT_CRASH_WINDOW_S


def _int_option(params: RendezvousParameters, key: str, default: int) -> int:
    try:
        value = params.get_as_int(key, default)
    except ValueError as exc:
        raise EtcdV3ConfigError(f"--rdzv-conf {key}={params.get(key)!r} is not an integer") from exc
    return default if value is None else value


def _flag(params: RendezvousParameters, key: str) -> bool:
    value = _int_option(params, key, 1)
    if value not in (0, 1):
        raise EtcdV3ConfigError(f"--rdzv-conf {key} must be 0 or 1, not {params.get(key)!r}")
    return bool(value)


def _lease_ttl(params: RendezvousParameters) -> int:
    lease_ttl = _int_option(params, "lease_ttl", DEFAULT_LEASE_TTL_S)
    floor = max(10, 3 * _int_option(params, "keep_alive_interval", 5))  # a few heartbeats must fit in one TTL
    if lease_ttl < 0 or 0 < lease_ttl < floor:
        raise EtcdV3ConfigError(f"lease_ttl={lease_ttl} must be 0 (keys never expire) or >= {floor} "
                                "(3 x keep_alive_interval, at least 10 s)")
    return lease_ttl


def parse_settings(params: RendezvousParameters) -> EtcdV3Settings:
    """Validate params.config (unknown keys, numbers and their ranges, TLS files, credentials) before any RPC."""
    check_keys(params.config)
    check_values(params.config)  # every number in its key's range: torch would fail only mid-rendezvous
    prefix = str(params.get("key_prefix") or DEFAULT_KEY_PREFIX)
    try:
        run_key(prefix, params.run_id, STATE_LEAF)
    except EtcdV3Error as exc:
        raise EtcdV3ConfigError(f"--rdzv-id: {exc}") from exc
    try:
        job_secret = secret(params.get("secret_file"))
    except EtcdV3Error as exc:
        raise EtcdV3ConfigError(str(exc)) from exc
    probe, warm, in_place = _flag(params, "peer_probe"), _flag(params, "warm_start"), _flag(params, "in_place")
    if in_place and not warm and params.get("in_place") is not None:
        raise EtcdV3ConfigError("--rdzv-conf in_place=1 needs warm_start=1 (the kept workers are forks of the warm "
                                "process): drop warm_start=0, or set in_place=0")
    window = timedelta(seconds=_int_option(params, "keep_alive_interval", 5)
                       * _int_option(params, "keep_alive_max_attempt", 3))  # torch's defaults
    last_call = timedelta(seconds=_int_option(params, "last_call_timeout", 30))
    # The agent rides out an etcd outage (preflight and status, which also read the schema, do not).
    conn = connection_spec(params.endpoint, {"outage_timeout": DEFAULT_OUTAGE_TIMEOUT_S, **params.config})
    crashes = (_int_option(params, "crash_limit", DEFAULT_CRASH_LIMIT),
               float(params.get("crash_window") or DEFAULT_CRASH_WINDOW_S))  # ranges: check_values above
    return EtcdV3Settings(conn, prefix, _lease_ttl(params), job_secret,
                          probe, window, last_call, warm, in_place and warm, *crashes)
