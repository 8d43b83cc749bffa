"""Process helpers used by the package, the tests and bench: parent death, /proc reading, the torchrun
command line, the child environment, and waiting on a condition with a deadline.

    python -c "from elastic_mnist.procs import torchrun_command; print(torchrun_command(['--standalone'], []))"

Linux-only where it touches prctl and /proc; elsewhere those helpers degrade to no-ops.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable

from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.env import AGENT_ONLY, agent_pid

_PR_SET_PDEATHSIG = 1
_LINUX = sys.platform.startswith("linux")


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def set_parent_death_signal(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies.

    `parent` is the pid that must be our parent (default: the launcher's, `launcher_pid()`). If it is not
    (it died before this call and we were handed to init or a subreaper), exit at once: nobody supervises
    us. A parent of pid 1 is no sign of that by itself: torchrun is PID 1 as a container's entrypoint.
    Linux ties the signal to the parent THREAD that forked us, so parents start such children from a
    thread that lives as long as they should."""
    if not _LINUX:
        return
    parent = launcher_pid() if parent is None else parent
    _libc().prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(exit_codes.FAILURE)


def launcher_pid() -> int:
    """The pid of the agent that started this process: what the etcd-v3 agent wrote for its workers
    ($ELASTIC_MNIST_AGENT_PID), else our parent now (another backend's agent; as early as possible)."""
    given = agent_pid()
    return os.getppid() if given is None else given


_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the one orphans of its descendants are handed to (as they would be to a
    container's PID 1), so that it can wait for them and reap them. False where the kernel cannot."""
    if not _LINUX:
        return False
    return _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def die_with_parent_preexec(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A Popen preexec_fn: the child gets `sig` when the parent dies (no orphans from a killed test)."""
    if not _LINUX:
        return None
    libc = _libc()  # loaded before fork: no dlopen in the child
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork() and prctl()
            os._exit(exit_codes.FAILURE)
    return preexec


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def proc_state(pid: int) -> str | None:
    """One-letter state (R, S, T, Z, ...) or None when there is no such process."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def proc_ppid(pid: int) -> int | None:
    fields = stat_fields(pid)
    return int(fields[1]) if fields else None


def start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (/proc/PID/stat field 22)."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields else None


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie."""
    state = proc_state(pid)
    return state is not None and state != "Z"


def children() -> dict[int, list[int]]:
    """ppid -> pids of every process, zombies too (a leader whose other threads run shows Z, and has children)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(int(entry))) is not None:
            tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def descendants(root: int, tree: dict[int, list[int]] | None = None) -> list[int]:
    """root and every live process below it (workers may sit in sessions of their own). `tree`: one
    `children()` read for several roots (each read opens every process's stat file)."""
    tree, out, todo = children() if tree is None else tree, [], [root]
    while todo:
        pid = todo.pop()
        if alive(pid):
            out.append(pid)
        todo += tree.get(pid, [])
    return out


def signal_tree(root: int, sig: int) -> float:
    """Signal root and every live process below it (a node's whole tree: agent, warm process, workers);
    a process that exits meanwhile is skipped. Returns when (time.time())."""
    for pid in descendants(root):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return time.time()


def torchrun_command(torchrun_args: list[str], module_args: list[str], module: str = "elastic_mnist.train",
                     script: str = "") -> list[str]:
    """The one way we start torchrun: this interpreter, so the agent and its workers share our venv.
    The workers run `python -m module` or, when given, `python script` (your own task)."""
    program = [script] if script else ["-m", module]
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args, *program, *module_args]


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a child that runs our code: no inherited rank variables (a test run under
    torchrun must not leak its own), this venv first on PATH, unbuffered output, and one intra-op
    thread unless the caller set more (several processes share few cores)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_",
                                                                     "ROLE_", "TORCHELASTIC", "MASTER_"))
           and k not in AGENT_ONLY}  # what an agent hands its own workers: never a test's child
    env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.05) -> object:
    """Poll a cheap predicate until it returns something truthy; TimeoutError naming `what` after the
    deadline. For conditions no file descriptor can signal (a line in a log another process writes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait for a process that is not our child to go away (pidfd where available); True if it did."""
    if hasattr(os, "pidfd_open"):
        import select

        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return True
        try:
            return bool(select.select([fd], [], [], timeout_s)[0]) or not alive(pid)
        finally:
            os.close(fd)
    try:
        wait_for(lambda: not alive(pid), timeout_s, f"pid {pid} to exit")
        return True
    except TimeoutError:
        return False


class BestEffortStream:
    """sys.stdout or sys.stderr whose writes never fail: progress lines are best effort. The first write or
    flush that the OS refuses (the reader of a pipe went away: `| head`, an agent's closed pipe) points the
    file descriptor at /dev/null, so this write, every later one (C code's included) and the interpreter's
    flush at exit all succeed. Anything else is the stream's own."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            self._silence()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            self._silence()

    def _silence(self) -> None:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._stream.fileno())
            finally:
                os.close(null)
            self._stream.flush()  # what stayed buffered goes to /dev/null now
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def best_effort_console() -> None:
    """Make this process's stdout and stderr best effort (BestEffortStream), once; a stream something else put
    in their place (a test's capture) is left alone."""
    for name, original in (("stdout", sys.__stdout__), ("stderr", sys.__stderr__)):
        stream = getattr(sys, name)
        if stream is not None and stream is original:
            setattr(sys, name, BestEffortStream(stream))
