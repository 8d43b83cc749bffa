"""The `--rdzv-conf` schema of `--rdzv-backend=etcd-v3`, in one place: the backend (etcd_v3.py),
`elastic-mnist preflight` and `elastic-mnist status` all read --rdzv-conf through it, so a key that
torchrun accepts is accepted by all three, and an unknown one is refused by all three in the same words.

    python -c "from elastic_mnist.rendezvous.conf import parse_conf; print(parse_conf('user=u,password_file=/p'))"

No torch or grpc import here (preflight and status stay fast); the etcd client is imported on first use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from elastic_mnist.errors import UserError
from elastic_mnist.torchrun_settings import RDZV_CONF

if TYPE_CHECKING:
    from elastic_mnist.rendezvous._client import EtcdConnectionSpec

BACKEND_NAME = "etcd-v3"
DEFAULT_READ_TIMEOUT_S = 10.0  # each etcd call's deadline: an unreachable etcd is one error within 10 s
DEFAULT_KEY_PREFIX = "/torchelastic/v3"  # next to torch's /torchelastic/p2p (v2), never inside it
DEFAULT_LEASE_TTL_S = 7200  # keys of a job that vanished expire after 2 h (_lease.py)
DEFAULT_OUTAGE_TIMEOUT_S = 360.0  # an etcd away this long (its pod rescheduled, a node drained) is ridden out


@dataclass(frozen=True)
class Key:
    """One --rdzv-conf key: what its value parses as, its default (None: unset), who reads it."""

    kind: type
    default: Any
    reader: str  # "handler" (torch's create_handler), "connection" (the etcd client), "backend", "torchrun"
    secret: bool = False  # on a command line every local user sees it (ps): accepted, with a warning


def _handler(name: str, torch_default: int) -> Key:
    # The tuned values torchrun_settings passes (and with_tuned_defaults fills in), else torch's own.
    return Key(int, RDZV_CONF[BACKEND_NAME].get(name, torch_default), "handler")


SCHEMA: Mapping[str, Key] = MappingProxyType({
    "join_timeout": _handler("join_timeout", 600),
    "last_call_timeout": _handler("last_call_timeout", 30),
    "close_timeout": _handler("close_timeout", 30),
    "heartbeat_timeout": _handler("heartbeat_timeout", 5),
    "keep_alive_interval": _handler("keep_alive_interval", 5),
    "keep_alive_max_attempt": _handler("keep_alive_max_attempt", 3),
    "protocol": Key(str, "http", "connection"),
    "cacert": Key(str, None, "connection"),
    "cert": Key(str, None, "connection"),
    "key": Key(str, None, "connection"),
    "user": Key(str, None, "connection"),
    "password_file": Key(str, None, "connection"),
    "password": Key(str, None, "connection", secret=True),
    "read_timeout": Key(float, DEFAULT_READ_TIMEOUT_S, "connection"),
    "outage_timeout": Key(float, DEFAULT_OUTAGE_TIMEOUT_S, "connection"),
    "secret_file": Key(str, None, "backend"),
    "key_prefix": Key(str, DEFAULT_KEY_PREFIX, "backend"),
    "lease_ttl": Key(int, DEFAULT_LEASE_TTL_S, "backend"),
    "peer_probe": Key(int, 1, "backend"),
    "warm_start": Key(int, 1, "backend"),
    "in_place": Key(int, 1, "backend"),
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


def parse_conf(text: str) -> dict[str, str]:
    """`KEY=VALUE,...` as torchrun splits it, every key checked against the schema."""
    conf = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise EtcdV3ConfigError(f"bad --rdzv-conf item {item!r}: expected KEY=VALUE")
        conf[key] = value
    check_keys(conf)
    return conf


def _number(conf: Mapping[str, Any], key: str) -> float | None:
    raw = conf.get(key)
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        raise EtcdV3ConfigError(f"--rdzv-conf {key}={raw!r} is not a number of seconds") from None


def connection_spec(endpoint: str, conf: Mapping[str, Any]) -> EtcdConnectionSpec:
    """How to reach etcd from conf's connection keys (the rest are ignored). user and password_file fall
    back to the environment; password= works with one warning (_secrets.credentials)."""
    from elastic_mnist.rendezvous._client import EtcdConnectionSpec, EtcdV3Error
    from elastic_mnist.rendezvous._secrets import credentials

    read_timeout = _number(conf, "read_timeout")
    outage = _number(conf, "outage_timeout")
    try:
        user, password = credentials(conf.get("user"), conf.get("password"), conf.get("password_file"))
        return EtcdConnectionSpec.parse(endpoint, conf.get("protocol"), read_timeout, user=user, password=password,
                                        **{k: conf.get(k) for k in ("cacert", "cert", "key")},
                                        **({} if outage is None else {"outage_timeout": outage}))
    except EtcdV3Error as exc:
        raise EtcdV3ConfigError(str(exc)) from exc


def describe() -> str:
    """The valid keys, for a --help text."""
    return ", ".join(sorted(VALID_KEYS))
