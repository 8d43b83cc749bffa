"""`elastic-mnist pod`: the trainer container's entry process (PID 1), with torchrun as its child.

    elastic-mnist pod --nnodes=1:4 --rdzv-backend=etcd-v3 --rdzv-endpoint=etcd-client:2379 \\
        --rdzv-id=$(RDZV_ID) ... -m elastic_mnist.train --checkpoint-dir=/data/checkpoints/$(JOB_NAME) ...

Takes torchrun's arguments word for word and adds what a pod needs around it:
  - SIGTERM (or SIGINT) at any moment reaches torchrun at once. torchrun as PID 1 would ignore it until
    its workers start (PID 1 has no default signal actions), so a pod deleted during start-up sat out
    its whole grace period. Not tini: this process must understand the job anyway (below), and as
    PID 1 it reaps the orphans tini would (workers whose agent died).
  - A pod that arrives after the job finished (a replacement, a late node) exits 0 with one line, from
    the finished.json rank 0 writes. One that finds the rendezvous closed without it (a node gave up;
    torchrun would fail with RendezvousClosedError on both backends, and every replacement again)
    exits 78 with one line: the Job fails at once and a re-applied Job resumes from the checkpoint.
  - The completion index is not checked against --nnodes: the Job has spare indexes (completions 8,
    parallelism 1..4) so that a lost index is replaced; its admission policy bounds parallelism.
Exit: torchrun's code, 0 when the job already finished, 78 on a configuration mistake or a closed
rendezvous.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from elastic_mnist import exit_codes, procs
from elastic_mnist.errors import UserError
from elastic_mnist.ops.preflight import Launch, closed_line, finished_line, parse_launch


class Forwarder:
    """Signal handlers that pass SIGTERM/SIGINT on to the child, remembering one that came first.

    Only the first is passed on: torchrun's agent answers every SIGTERM by raising in whatever it is
    doing, so a second one (a VM shutting down signals us and torchrun at once, and we forward) cuts
    short its wait for the workers' save and leaves them to die with this container."""

    def __init__(self) -> None:
        self.child: int | None = None
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        if self.received is not None:
            return
        self.received = signum
        self.forward()

    def forward(self) -> None:
        if self.child is not None and self.received is not None:
            try:
                os.kill(self.child, self.received)
            except ProcessLookupError:
                pass


def _wait(pid: int) -> int:
    """The child's exit code; as PID 1 also reaps every orphan that is handed to us meanwhile."""
    while True:
        reaped, status = os.waitpid(-1 if os.getpid() == 1 else pid, 0)
        if reaped == pid:
            return os.waitstatus_to_exitcode(status)


def _verdict(launch: Launch, config) -> int | None:
    """Exit code (after one line) for a node that must not (re)join: 0 finished, 78 closed; else None."""
    done = finished_line(config.checkpoint_dir, config.max_steps)
    if done:
        print(f"elastic-mnist pod: {done}", flush=True)
        return exit_codes.OK
    ended = closed_line(launch)
    if ended:
        print(f"elastic-mnist pod: error: {ended}", flush=True)
        return exit_codes.PERMANENT
    return None


def run(argv: list[str]) -> int:
    forwarder = Forwarder()  # first: a SIGTERM during the checks below must end us, not be lost
    if "-m" not in argv:
        raise UserError("expected torchrun's arguments, then -m MODULE and its flags")
    module = argv[argv.index("-m") + 1]
    launch = parse_launch(argv)
    from elastic_mnist.config import parse_args

    config = parse_args(launch.train_args)
    verdict = _verdict(launch, config)
    if verdict is not None:
        return verdict
    if forwarder.received:
        return exit_codes.killed_by(forwarder.received)
    torchrun_args = argv[:argv.index("-m")]
    child = subprocess.Popen(procs.torchrun_command(torchrun_args, launch.train_args, module), env=procs.child_env(),
                             preexec_fn=procs.die_with_parent_preexec(signal.SIGTERM))
    forwarder.child = child.pid
    forwarder.forward()  # a signal that arrived between the check above and Popen
    code = _wait(child.pid)
    child.returncode = code  # reaped by us: keep Popen from waiting again
    if code != 0 and forwarder.received is None:
        verdict = _verdict(launch, config)
        if verdict is not None:
            return verdict
    return code if code >= 0 else exit_codes.killed_by(-code)


def main(argv: list[str] | None = None) -> int:
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        print(f"elastic-mnist pod: error: {e}", flush=True)
        return exit_codes.PERMANENT


if __name__ == "__main__":
    sys.exit(main())
