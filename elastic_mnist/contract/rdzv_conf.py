"""The `--rdzv-conf` schema of `--rdzv-backend=etcd-v3`, in one place: the backend (etcd_v3.py),
`elastic-mnist preflight` and `elastic-mnist status` all read --rdzv-conf through it, so a key that
torchrun accepts is accepted by all three, and an unknown one is refused by all three in the same words.

    python -c "from elastic_mnist.contract.rdzv_conf import parse_conf; print(parse_conf('user=u,password_file=/p'))"

No torch or grpc import here (preflight and status stay fast); the etcd client is imported on first use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from elastic_mnist.contract.errors import UserError
from elastic_mnist.contract.torchrun import RDZV_CONF

BACKEND_NAME = "etcd-v3"
DEFAULT_READ_TIMEOUT_S = 10.0  # each etcd call's deadline: an unreachable etcd is one error within 10 s
DEFAULT_KEY_PREFIX = "/torchelastic/v3"  # next to torch's /torchelastic/p2p (v2), never inside it
DEFAULT_LEASE_TTL_S = 7200  # keys of a job that vanished expire after 2 h (_lease.py)
DEFAULT_OUTAGE_TIMEOUT_S = 360.0  # an etcd away this long (its pod rescheduled, a node drained) is ridden out
# A node gives up when its own workers fail more than this often (_budget.py): a crash loop ends within
# minutes, while a week on spot, whose departures and joins count nothing, never comes near it.
DEFAULT_CRASH_LIMIT = 10
DEFAULT_CRASH_WINDOW_S = 3600.0


# The longest any of the seconds keys may be: far beyond what a job waits for, far below what Python's
# timedelta (~8.6e13 s) and etcd's lease TTL (9e9 s) hold, so no value can overflow where it is used.
MAX_SECONDS = 30 * 24 * 3600
MAX_ATTEMPTS = 1000


@dataclass(frozen=True)
class Key:
    """One --rdzv-conf key: what its value parses as, its default (None: unset), who reads it, and for a
    number the range it must lie in (check_values; NaN and infinity never do)."""

    kind: type
    default: Any
    reader: str  # "handler" (torch's create_handler), "connection" (the etcd client), "backend", "torchrun"
    secret: bool = False  # on a command line every local user sees it (ps): accepted, with a warning
    low: float | None = None  # the smallest value accepted (numbers)
    high: float | None = None  # the largest


def _handler(name: str, torch_default: int, high: int = MAX_SECONDS) -> Key:
    # The tuned values torchrun_settings passes (and with_tuned_defaults fills in), else torch's own.
    return Key(int, RDZV_CONF[BACKEND_NAME].get(name, torch_default), "handler", low=1, high=high)


SCHEMA: Mapping[str, Key] = MappingProxyType({
    "join_timeout": _handler("join_timeout", 600),
    "last_call_timeout": _handler("last_call_timeout", 30),
    "close_timeout": _handler("close_timeout", 30),
    "heartbeat_timeout": _handler("heartbeat_timeout", 5),
    "keep_alive_interval": _handler("keep_alive_interval", 5),
    "keep_alive_max_attempt": _handler("keep_alive_max_attempt", 3, high=MAX_ATTEMPTS),
    "protocol": Key(str, "http", "connection"),
    "cacert": Key(str, None, "connection"),
    "cert": Key(str, None, "connection"),
    "key": Key(str, None, "connection"),
    "user": Key(str, None, "connection"),
    "password_file": Key(str, None, "connection"),
    "password": Key(str, None, "connection", secret=True),
    "read_timeout": Key(float, DEFAULT_READ_TIMEOUT_S, "connection", low=0.001, high=MAX_SECONDS),
    "outage_timeout": Key(float, DEFAULT_OUTAGE_TIMEOUT_S, "connection", low=0, high=MAX_SECONDS),
    "secret_file": Key(str, None, "backend"),
    "key_prefix": Key(str, DEFAULT_KEY_PREFIX, "backend"),
    "lease_ttl": Key(int, DEFAULT_LEASE_TTL_S, "backend", low=0, high=MAX_SECONDS),
    "peer_probe": Key(int, 1, "backend", low=0, high=1),
    "warm_start": Key(int, 1, "backend", low=0, high=1),
    "in_place": Key(int, 1, "backend", low=0, high=1),
    "crash_limit": Key(int, DEFAULT_CRASH_LIMIT, "backend", low=1, high=MAX_ATTEMPTS),
    "crash_window": Key(float, DEFAULT_CRASH_WINDOW_S, "backend", low=1, high=MAX_SECONDS),
    # torchrun's LaunchConfig always adds `timeout` (--rdzv-timeout, 900 s by default); like torch's own
    # dynamic backends we ignore it: the join deadline is join_timeout.
    "timeout": Key(int, None, "torchrun"),
})
VALID_KEYS = frozenset(SCHEMA)
HANDLER_KEYS = tuple(k for k, v in SCHEMA.items() if v.reader == "handler")
CONNECTION_KEYS = tuple(k for k, v in SCHEMA.items() if v.reader == "connection")
SECRET_KEYS = frozenset(k for k, v in SCHEMA.items() if v.secret)


class EtcdV3ConfigError(ValueError, UserError):
    """A bad --rdzv-conf for etcd-v3 (a ValueError, as torch raises for bad rendezvous options)."""


def check_keys(keys: Any) -> None:
    """Refuse keys the schema does not know, naming them and every valid key."""
    unknown = sorted(set(keys) - VALID_KEYS)
    if unknown:
        raise EtcdV3ConfigError(f"unknown --rdzv-conf key(s) for {BACKEND_NAME}: {', '.join(unknown)}; "
                                f"valid keys: {', '.join(sorted(VALID_KEYS))}")


def value_of(key: str, raw: Any) -> Any:
    """raw (text from the command line, or a number) as its key's kind, within the key's range: else one
    EtcdV3ConfigError naming the key, the value and what to give instead."""
    spec = SCHEMA[key]
    if spec.kind not in (int, float) or raw is None:
        return raw
    word = "an integer" if spec.kind is int else "a number"
    try:
        value = spec.kind(raw if isinstance(raw, (int, float)) else str(raw).strip())
    except (TypeError, ValueError):
        raise EtcdV3ConfigError(f"--rdzv-conf {key}={raw!r} is not {word}; give {_range(spec)}") from None
    finite = spec.kind is int or math.isfinite(value)  # an int of any size compares without overflow
    if not finite or not (spec.low is None or value >= spec.low) or not (spec.high is None or value <= spec.high):
        raise EtcdV3ConfigError(f"--rdzv-conf {key}={raw!r} is out of range; give {_range(spec)}")
    return value


def _range(spec: Key) -> str:
    if (spec.low, spec.high) == (0, 1) and spec.kind is int:
        return "0 or 1"
    word = "an integer" if spec.kind is int else "a number"
    if spec.low is None or spec.high is None:
        return word
    unit = " (seconds)" if spec.high == MAX_SECONDS else ""
    return f"{word} from {spec.low:g} to {spec.high:.0f}{unit}"


def check_values(conf: Mapping[str, Any]) -> None:
    """Refuse any number the schema does not admit (check_keys first: unknown keys are named there).
    torchrun's own `timeout` is torchrun's to check."""
    for key, raw in conf.items():
        if key in SCHEMA and SCHEMA[key].reader != "torchrun":
            value_of(key, raw)


def parse_conf(text: str) -> dict[str, str]:
    """`KEY=VALUE,...` as torchrun splits it, every key and value checked against the schema."""
    conf = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise EtcdV3ConfigError(f"bad --rdzv-conf item {item!r}: expected KEY=VALUE")
        conf[key] = value
    check_keys(conf)
    check_values(conf)
    return conf


def describe() -> str:
    """The valid keys, for a --help text."""
    return ", ".join(sorted(VALID_KEYS))
