"""What an etcd-v3 torchrun agent shares with its workers beyond torchrun's environment: its pid, and a
private directory of its own (0700) for the warm process's socket, a worker's configuration error, and the
note by which a worker tells its agent that its round ended for a membership change.

    python -c "from elastic_mnist import agent_link; print(agent_link.create({}))"

A worker that finds a configuration error (a bad flag, missing data, a checkpoint of another model) writes
the one line it printed into that directory and exits 78. The agent reads it before it would rendezvous
again, closes the job's rendezvous with that line, and every agent of the job ends with it (exit 78)
instead of restarting workers that fail the same way (rendezvous/_verdict.py). A problem of its node only (its
own checkpoint dir unusable: NodeLocalError) goes under another name, and exit 69: the agent leaves the
rendezvous and ends this node alone, the job trains on.

A process torchrun started whose round ended for a membership change (a peer lost, stopped or joining; a
group that did not form) does not exit with it: `end_process` writes ROUND_OVER here and waits until the
agent takes it. torch's agent counts every worker that exits non-zero against --max-restarts, but restarts
a healthy group for free when a node waits to join: the agent's handler reports the note as such a node
(rendezvous/_budget.py), so a peer's departure never spends this node's restarts. Standard library only.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import signal
import stat
import sys
import threading
import time
from contextlib import suppress

from elastic_mnist import files, procs
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.env import agent_dir, agent_pid, set_agent_dir

CONFIG_ERROR = "config-error"
ROUND_OVER = "round-over"  # a worker's round ended for a membership change: restart it, count nothing
STOPPING = "stopping"  # the agent is stopping its workers for a new round: a worker ending its round just exits
ROUND_OVER_WAIT_S = 30.0
"""How long a worker waits for its agent to take ROUND_OVER (the agent looks every --monitor-interval, 0.1 s)
before it exits anyway, as a failure torchrun counts: an agent that does not look is not ours to wait for."""
_POLL_S = 0.01
_MAX_LINE = 4096  # a line, not a file: what a worker writes here is read back bounded


PREFIX = "elastic-mnist-agent-"
LOCK = "alive"  # in each agent's directory: locked (flock) by its agent for as long as it lives
_HELD: list[int] = []


def create(environ=os.environ) -> str:
    """A new private directory for this agent, named in `environ` for its workers; removed at exit. The agent
    holds a lock on a file in it for its lifetime: the directories of agents that were killed (no exit
    handler ran) are removed by the next agent of this user on this machine, whatever pid namespace each
    runs in (a pid says nothing across them; a lock does)."""
    import shutil  # here and below, not at the top: every stand-in imports this module, and needs neither
    import tempfile

    parent = tempfile.gettempdir()
    sweep_dead(parent)
    name = f"{PREFIX}{os.getpid()}-{procs.start_ticks(os.getpid())}-"
    building = tempfile.mkdtemp(prefix=f".{name}", dir=parent)  # 0700, ours; hidden from sweepers until locked
    fd = os.open(os.path.join(building, LOCK), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _HELD.append(fd)  # released by the kernel when this process ends, however it ends
    path = os.path.join(parent, os.path.basename(building)[1:])
    os.rename(building, path)
    set_agent_dir(environ, path)
    atexit.register(shutil.rmtree, path, True)
    return path


def sweep_dead(parent: str) -> list[str]:
    """Remove this user's agent directories under `parent` whose agent is gone (nobody holds its lock)."""
    import shutil

    removed = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        pid, ticks, *_ = (name[len(PREFIX):].split("-") + ["", ""])
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and pid.isdigit() and ticks.isdigit()):
            continue  # not one this runtime made for this user: never touched
        if _owner_gone(path, int(pid), int(ticks)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _owner_gone(path: str, pid: int, ticks: int) -> bool:
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:  # made by an agent of an earlier version, which locked nothing: its pid and start
        return procs.start_ticks(pid) != ticks  # time (in this pid namespace) are all there is to go by
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # only while its agent lives does this fail
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def directory(environ=os.environ) -> str:
    """The agent's directory as handed to this worker ("" when not started by an etcd-v3 agent)."""
    return agent_dir(environ)


def report_config_error(line: str, environ=os.environ) -> bool:
    """Hand the agent the configuration error this worker exits with; False without such an agent."""
    return _report(CONFIG_ERROR, line, environ)


def _report(name: str, line: str, environ) -> bool:
    where = directory(environ)
    if not where or not os.path.isdir(where):
        return False
    files.atomic_write(os.path.join(where, name), line[:_MAX_LINE] + "\n", 0o600)
    return True


def config_error(where: str) -> str | None:
    """The line a worker of this agent reported, if any."""
    return _reported(where, CONFIG_ERROR)


def _reported(where: str, name: str) -> str | None:
    path = os.path.join(where, name)
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


NODE_LOCAL = "node-local"


def report_node_local(line: str, environ=os.environ) -> bool:
    """Hand the agent the problem of this node only (NodeLocalError) this worker exits 69 with: the agent
    leaves the job's rendezvous and ends this node, the job goes on; False without such an agent."""
    return _report(NODE_LOCAL, line, environ)


def node_local(where: str) -> str | None:
    """The node-local line a worker of this agent reported, if any."""
    return _reported(where, NODE_LOCAL)


def _note(name: str, environ=os.environ) -> str:
    """The path of note `name` in this process's agent directory ("" without one)."""
    where = directory(environ)
    return os.path.join(where, name) if where and os.path.isdir(where) else ""


def mark_stopping(where: str, stopping: bool) -> None:
    """The agent's side: set while it stops its workers for the next round (from its decision to the next
    rendezvous), so that a worker whose round ends meanwhile does not wait for a note nobody will take."""
    path = os.path.join(where, STOPPING) if where else ""
    with suppress(OSError):
        if stopping:
            files.atomic_write(path, "", 0o600)
        else:
            os.unlink(path)


def stopping_for_round(environ=os.environ) -> bool:
    """The worker's side: its agent is stopping it for the next round (a join, a peer's round-over), not
    ending the node. Read when a stop signal comes: the agent sets the note before it signals."""
    path = _note(STOPPING, environ)
    return bool(path) and os.path.exists(path)


def take_round_over(where: str) -> bool:
    """The agent's side: True once for each note a worker left (removing it lets that worker exit)."""
    try:
        os.unlink(os.path.join(where, ROUND_OVER))
        return True
    except OSError:
        return False


def end_process(code: int, environ=os.environ, stopped: bool = False) -> None:
    """Exit with `code` (never returns). A process its etcd-v3 agent started, whose round ended for a membership change
    (RESTART), first leaves ROUND_OVER for the agent and waits until the agent takes it (or stops it).
    `stopped`: a stop signal already came (the agent is stopping its workers, or the node ends): no wait."""
    with suppress(Exception):  # a closed or broken pipe must not keep the process alive
        sys.stdout.flush()
        sys.stderr.flush()
    if code == exit_codes.RESTART and not stopped and _started_by_agent(environ):
        path, stopping = _note(ROUND_OVER, environ), _note(STOPPING, environ)
        if path and not os.path.exists(stopping):
            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the agent's stop ends us at once
                    signal.signal(sig, signal.SIG_DFL)
            with suppress(OSError):
                files.atomic_write(path, "", 0o600)
                deadline = time.monotonic() + ROUND_OVER_WAIT_S
                while os.path.exists(path) and not os.path.exists(stopping) and time.monotonic() < deadline:
                    time.sleep(_POLL_S)  # a file the agent removes: no descriptor signals that
    os._exit(code)


def _started_by_agent(environ) -> bool:
    """torchrun's own child (a stand-in or a cold worker), not a fork of the warm process."""
    agent = agent_pid(environ)
    return agent is not None and os.getppid() == agent
