"""Every exit code elastic-mnist gives, once each: workers, torchrun's agents, preflight, pod and the CLI.

    python -c "from elastic_mnist.contract import exit_codes; print(exit_codes.PERMANENT)"

The numbers follow sysexits.h where one fits, so a Kubernetes podFailurePolicy, torchrun and a shell
read them the usual way. Changing one breaks the manifests' onExitCodes (tests/test_k8s.py checks them).
"""

from __future__ import annotations

import signal

OK = 0  # done, or nothing left to do (the job already finished; a stop we asked for)
FAILURE = 1  # could not go on, as an uncaught exception exits (etcd died; a child orphaned at fork)
USAGE = 2  # bad flags or input, as argparse exits: fix the command line
NODE_LOCAL = 69  # sysexits EX_UNAVAILABLE: this node lacks what the job needs (no CUDA device, checkpoint dir
#                 not writable here, no usable /dev/shm) or its GPU failed while training (worker/devicefault.py);
#                 another node may do better: the Job's podFailurePolicy fails that pod's index (FailIndex), not the
#                 whole Job
UNSUPERVISED = 70  # sysexits EX_SOFTWARE: the agent died and the group could not agree on a stop in time
SAVE_FAILED = 74  # sysexits EX_IOERR: a peer was lost and saving the last completed step raised or hung past
# its bound; torchrun restarts us from the newest earlier state. Also: the final state could not go to a full or
# read-only checkpoint volume and stays in the in-memory snapshots, from which the restart writes it
RESTART = 75  # sysexits EX_TEMPFAIL, "try again": the group stopped for a membership change; torchrun restarts us
TRANSIENT = RESTART  # the same EX_TEMPFAIL from preflight: etcd still unreachable; the pod's restart retries
PERMANENT = 78  # sysexits EX_CONFIG: no retry on any node can help (a configuration mistake, a closed
#                 rendezvous); the Job's podFailurePolicy fails the Job on it
SIGNAL_BASE = 128  # the shell's convention: 128 + N for a process ended by signal N
INTERRUPTED = SIGNAL_BASE + signal.SIGINT  # 130: Ctrl-C (or SIGTERM turned into KeyboardInterrupt)


def killed_by(signum: int) -> int:
    """The code a shell reports for death by signal `signum` (a PID 1 that handles SIGTERM exits so)."""
    return SIGNAL_BASE + int(signum)
