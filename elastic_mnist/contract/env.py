"""Every environment variable of ours, named once: who sets it and who reads it, and what an agent hands its
workers as typed values (read and written only through the functions below).

    python -c "from elastic_mnist.contract import env; print([v for k, v in vars(env).items() if k.endswith('_ENV')])"

Nothing outside this package spells an `ELASTIC_MNIST_` name (tests/test_layout.py checks it).
"""

import json
import os
from collections.abc import MutableMapping

PREFIX = "ELASTIC_MNIST_"  # every variable below; a kept worker's round sets them anew (warm/become.py)

# Set by the user or a pod spec.
DATA_DIR_ENV = PREFIX + "DATA_DIR"  # the data root: a pod spec points every command at a mounted volume
CACHE_DIR_ENV = PREFIX + "CACHE_DIR"  # the decoded-data cache (data/cache.py), default ~/.cache/elastic-mnist
# Fallbacks for --rdzv-conf user/password_file/secret_file, so secrets stay off command lines
# (etcd/secrets.py); the agent hands the secret file's path on to its workers (job_secret.py).
USER_ENV = PREFIX + "ETCD_USER"
PASSWORD_FILE_ENV = PREFIX + "ETCD_PASSWORD_FILE"
SECRET_FILE_ENV = PREFIX + "RDZV_SECRET_FILE"
NODE_LOCAL_HOLD_ENV = PREFIX + "NODE_LOCAL_HOLD_S"  # how long a node-local exit stays running (ops/preflight.py)
POD_STOP_ENV = PREFIX + "STOP_S"  # after a SIGTERM the pod entry ends everything within this (ops/pod.py)
FAULT_ENV = PREFIX + "FAULT"  # a fault a test plants in a worker (worker/fault_points.py)

# Set by an etcd-v3 agent for the workers it starts.
# Its own pid, so a worker tells "my agent died before I looked" from "my agent is PID 1" (torchrun as a
# container's entrypoint).
AGENT_PID_ENV = PREFIX + "AGENT_PID"
AGENT_DIR_ENV = PREFIX + "AGENT_DIR"  # the agent's private directory: notes between it and its workers
WARM_ADDRESS_ENV = PREFIX + "WARM"  # where its warm process listens (elastic_mnist/warm)
WARM_TOKEN_ENV = PREFIX + "WARM_TOKEN"  # the token its warm process serves
# JSON node -> host:port of the peers' beacons: a late heartbeat probes them (netprobe.py).
PEER_BEACONS_ENV = PREFIX + "PEER_BEACONS"
# Set in a worker forked from a warm process: the wall time its stand-in was exec()ed by torchrun, where this
# worker's start really began (its own kernel start time is the fork).
STARTED_AT_ENV = PREFIX + "STARTED_AT"
# What a worker's agent alone may set: a child that is not an agent's worker must not inherit them (procs.py).
AGENT_ONLY = (WARM_ADDRESS_ENV, WARM_TOKEN_ENV, STARTED_AT_ENV, AGENT_PID_ENV, AGENT_DIR_ENV)

# Set by a launcher (elastic-mnist local: n0, n1, ...) for the node's processes: workers stamp their journal
# records with it (default: the host name), so a reader knows where each record came from.
NODE_ENV = PREFIX + "NODE"

Environ = MutableMapping[str, str]


def agent_pid(environ: Environ = os.environ) -> int | None:
    given = environ.get(AGENT_PID_ENV, "")
    return int(given) if given.isdigit() else None


def set_agent_pid(environ: Environ, pid: int) -> None:
    environ[AGENT_PID_ENV] = str(pid)


def agent_dir(environ: Environ = os.environ) -> str:
    """"" when not started by an etcd-v3 agent."""
    return environ.get(AGENT_DIR_ENV, "")


def set_agent_dir(environ: Environ, path: str) -> None:
    environ[AGENT_DIR_ENV] = path


def take_warm(environ: Environ = os.environ) -> tuple[str, str]:
    """(address, token) of the agent's warm process, removed from the environment: for the stand-in only, never
    the worker it becomes."""
    return environ.pop(WARM_ADDRESS_ENV, ""), environ.pop(WARM_TOKEN_ENV, "")


def set_warm(environ: Environ, address: str, token: str) -> None:
    environ[WARM_ADDRESS_ENV], environ[WARM_TOKEN_ENV] = address, token


def peer_beacons(environ: Environ = os.environ) -> dict[str, str]:
    """node -> host:port; {} for anything our agent does not write (then no probes: the heartbeat alone
    decides)."""
    try:
        value = json.loads(environ.get(PEER_BEACONS_ENV) or "{}")
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def set_peer_beacons(environ: Environ, beacons: dict[str, str]) -> None:
    environ[PEER_BEACONS_ENV] = json.dumps(beacons)


def started_at(environ: Environ = os.environ) -> float | None:
    """The wall time a warm child's stand-in was started (None: not a warm child)."""
    try:
        return float(environ[STARTED_AT_ENV]) if environ.get(STARTED_AT_ENV) else None
    except ValueError:
        return None


def set_started_at(environ: Environ, when: float) -> None:
    environ[STARTED_AT_ENV] = repr(float(when))
