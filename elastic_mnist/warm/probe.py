"""Whether a fork of the warm process can run torch: proven by a probe child, never assumed.

    python -c "import torch; from elastic_mnist.warm.probe import fork_refusal; print(repr(fork_refusal()))"

A fork copies memory, not threads. Anything the warm process imported that ran a torch op left thread pools
behind (OpenMP's), and a child's first parallel op then waits for threads that do not exist: it hangs. A
process that touched CUDA (even `torch.cuda.is_available()`) has children that cannot use CUDA. So after
every import the warm process forks a probe that runs a small parallel op and asks torch whether it is a
bad fork, within PROBE_TIMEOUT_S; until one passes, nothing is forked and workers start cold, each saying why.
"""

from __future__ import annotations

import os
import select
import signal
import sys

PROBE_TIMEOUT_S = 20.0
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

        from elastic_mnist import _torch_compat as compat

        if compat.cuda_bad_fork():
            return _CUDA
        torch.set_num_threads(max(2, torch.get_num_threads()))
        a = torch.ones(256, 256)
        (a @ a).sum().item()
        return 0
    except BaseException:  # noqa: BLE001 - whatever it is, this fork cannot be trusted to train
        return _FAILED
