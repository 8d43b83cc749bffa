"""What an etcd-v3 torchrun agent shares with its workers beyond torchrun's environment: its pid, and a
private directory of its own (0700) for the warm process's socket and for a worker's configuration error.

    python -c "from elastic_mnist import agent_link; print(agent_link.create({}))"

A worker that finds a configuration error (a bad flag, missing data, a checkpoint of another model) writes
the one line it printed into that directory and exits 78. The agent reads it before it would rendezvous
again, closes the job's rendezvous with that line, and every agent of the job ends with it (exit 78)
instead of restarting workers that fail the same way (rendezvous/_verdict.py). Standard library only.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile

from elastic_mnist import files

AGENT_DIR_ENV = "ELASTIC_MNIST_AGENT_DIR"
CONFIG_ERROR = "config-error"
_MAX_LINE = 4096  # a line, not a file: what a worker writes here is read back bounded


def create(environ=os.environ) -> str:
    """A new private directory for this agent, named in `environ` for its workers; removed at exit."""
    path = tempfile.mkdtemp(prefix="elastic-mnist-agent-")  # 0700, owned by this user
    environ[AGENT_DIR_ENV] = path
    atexit.register(shutil.rmtree, path, True)
    return path


def directory(environ=os.environ) -> str:
    """The agent's directory as handed to this worker ("" when not started by an etcd-v3 agent)."""
    return environ.get(AGENT_DIR_ENV, "")


def report_config_error(line: str, environ=os.environ) -> bool:
    """Hand the agent the configuration error this worker exits with; False without such an agent."""
    where = directory(environ)
    if not where or not os.path.isdir(where):
        return False
    files.atomic_write(os.path.join(where, CONFIG_ERROR), line[:_MAX_LINE] + "\n", 0o600)
    return True


def config_error(where: str) -> str | None:
    """The line a worker of this agent reported, if any."""
    path = os.path.join(where, CONFIG_ERROR)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, _MAX_LINE + 1).decode(errors="replace").strip() or None
    finally:
        os.close(fd)
