"""Whether a fork of the warm process can run torch: proven by a probe child, never assumed.

    python -c "import torch; from elastic_mnist.warm.probe import fork_refusal; print(repr(fork_refusal()))"

A fork copies memory, not threads. Anything the warm process imported that ran a torch op left thread pools
behind (OpenMP's), and a child's first parallel op then waits for threads that do not exist: it hangs. A
process that touched CUDA (even `torch.cuda.is_available()`) has children that cannot use CUDA. A thread that
an import started (Python's or native) is not in the child either, and a lock it held at the fork stays held
there: the worker deadlocks at its first use of it. So after its imports (at its start) the warm process
counts its threads and forks a probe that runs a small parallel op and asks torch whether it is a bad fork,
within PROBE_TIMEOUT_S; until both pass, nothing is forked and workers start cold, each saying why.
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import sys
import threading

from elastic_mnist.contract.warm import PROBE_TIMEOUT_S


class Preloads:
    """The modules the warm process imported for its workers, and whether a fork of it is still proven safe."""

    def __init__(self, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.timeout_s, self.failed, self.refusal = timeout_s, set(), ""
        self._proven: set[str] = set()
        self._tasks = 1  # this process's own threads: its main one, and those torch's import starts

    def load(self, names) -> str:
        """Import `names` (a failure is the worker's to report, as a cold start would), then prove the fork
        again if anything new was loaded; "" while forks are safe, else why not (said once)."""
        for name in names:
            if name in sys.modules or name in self.failed:
                continue
            try:
                importlib.import_module(name)
                if name == "torch":  # its import starts a native thread of its own; the probe proves torch
                    self._tasks = _tasks()
            except Exception as exc:  # noqa: BLE001 - the child imports it again and reports the error itself
                self.failed.add(name)
                print(f"elastic-mnist warm start: could not preload {name}: {exc}", file=sys.stderr, flush=True)
        loaded = set(sys.modules)
        if not self.refusal and not loaded <= self._proven:
            threads = thread_refusal(self._tasks)  # counted before the probe's fork (torch's thread ends at one)
            self.refusal, self._proven = fork_refusal(self.timeout_s) or threads, loaded
            if self.refusal:
                print(f"elastic-mnist warm start: workers start cold: {self.refusal}", file=sys.stderr, flush=True)
        return self.refusal


def _tasks() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def thread_refusal(expected_tasks: int) -> str:
    """"" when this process runs no thread beyond its main one (and the `expected_tasks` torch started), else
    why a fork of it is unsafe: a fork keeps only the forking thread, so a lock another thread held at the
    fork stays held in the child for good, and the first worker code that takes it deadlocks. Threads a
    probe child cannot see: checked here, in the warm process itself."""
    python = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    tasks = _tasks()
    if not python and tasks <= expected_tasks:
        return ""
    names = f" ({', '.join(python[:3])})" if python else ""
    return (f"something the warm process imported started {max(len(python), tasks - expected_tasks)} thread(s)"
            f"{names}, and a fork keeps none of them: a lock one held at the fork stays held in the worker, which "
            "deadlocks; start no thread at import in the preload")


_CUDA, _FAILED = 3, 4


def fork_refusal(timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """"" when a fork of this process runs torch, else why not (one line)."""
    if "torch" not in sys.modules:
        return ""
    pid = os.fork()
    if pid == 0:
        os._exit(_probe())
    pidfd = os.pidfd_open(pid)
    try:
        finished = bool(select.select([pidfd], [], [], timeout_s)[0])
        if not finished:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(pidfd)
    code = os.waitstatus_to_exitcode(status)
    if not finished:
        return (f"a fork of the warm process hung in its first torch op ({timeout_s:.0f} s): something it imported "
                "ran a torch op, and the thread pools that left behind do not survive a fork; import nothing that "
                "runs torch ops at import in the preload")
    if code == _CUDA:
        return ("CUDA was initialised in the warm process (even torch.cuda.is_available() does that): a fork of it "
                "cannot use CUDA; do not touch torch.cuda at import in the preload")
    return "" if code == 0 else f"a fork of the warm process could not run a torch op (exit {code})"


def _probe() -> int:
    try:
        import torch

        from elastic_mnist.compat import private as compat

        if compat.cuda_bad_fork():
            return _CUDA
        torch.set_num_threads(max(2, torch.get_num_threads()))
        a = torch.ones(256, 256)
        (a @ a).sum().item()
        return 0
    except BaseException:  # noqa: BLE001 - whatever it is, this fork cannot be trusted to train
        return _FAILED
