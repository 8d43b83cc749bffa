"""`elastic-mnist pod`: the trainer container's entry process (PID 1), with torchrun as its child.

    elastic-mnist pod --nnodes=1:4 --rdzv-backend=etcd-v3 --rdzv-endpoint=etcd-client:2379 \\
        --rdzv-id=$(RDZV_ID) ... -m elastic_mnist.train --checkpoint-dir=/data/checkpoints/$(JOB_NAME) ...

Takes torchrun's arguments word for word and adds what a pod needs around it:
  - SIGTERM (or SIGINT) at any moment reaches torchrun at once. torchrun as PID 1 would ignore it until
    its workers start (PID 1 has no default signal actions), so a pod deleted during start-up sat out
    its whole grace period. Before torchrun starts there is nothing to save: the pod exits at once.
  - It is the container's reaper (PID 1, or a child subreaper when run elsewhere): orphans are handed
    to it, and after torchrun exits it waits for the container's remaining processes (a warm process,
    workers finishing a save) for at most DRAIN_S, so that a save in flight is not cut by the end of
    the container.
  - After a SIGTERM everything ends within $ELASTIC_MNIST_STOP_S (default STOP_S): what is still
    running then is killed and the pod exits 143 itself, before the kubelet's SIGKILL at the end of the
    grace period would turn a slow stop into 137 (which the Job reads as an out-of-memory kill).
  - A pod that arrives after the job finished (a replacement, a late node) exits 0 with one line, from
    the finished.json rank 0 writes. One that finds the rendezvous closed without it (a node gave up;
    torchrun would fail with RendezvousClosedError on both backends, and every replacement again)
    exits 78 with one line: the Job fails at once and a re-applied Job resumes from the checkpoint.
  - Under etcd-v3 a node's restarts are limited by rate, not by a lifetime count: torchrun's
    --max-restarts is raised to POD_MAX_RESTARTS, and the backend's crash_limit within crash_window
    (own failures only: a peer's departure or a join counts nothing) ends the node with 69, which fails
    its index (FailIndex) and marks its node, without closing the rendezvous for the others.
Exit: 0 when the job finished (also when stopped at its end); 128+N after signal N that this process
passed on to torchrun (torchrun itself exits 1 on SIGTERM: torch raises SignalException out of its
launcher); 78 on a configuration mistake or a closed rendezvous; 69 when this node gave up (too many
failures of its own, or a problem of this node only); else torchrun's code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from elastic_mnist import procs
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.env import POD_STOP_ENV
from elastic_mnist.contract.errors import UserError
from elastic_mnist.ops.preflight import Launch, closed_line, finished_line, hold_node_local, parse_launch

STOP_S = 50.0  # after a SIGTERM: torchrun's shutdown (30 s by default) plus DRAIN_S, with a margin
DRAIN_S = 15.0  # after torchrun exits: how long the container's other processes may take to end
_KILL_WAIT_S = 5.0  # after SIGKILL: a process stuck in the kernel (a hung NFS write) is left to the container's end
# torchrun's lifetime budget in a pod under etcd-v3: out of reach in any real run, so that only the backend's
# crash rate (rendezvous/_budget.py) ends a node. A week of spot changes spends none of either.
POD_MAX_RESTARTS = 1_000_000


def _say(line: str) -> None:
    """One line on stdout with a plain write: safe inside a signal handler, whatever print() was doing."""
    os.write(1, f"elastic-mnist pod: {line}\n".encode())


def kill_descendants() -> list[int]:
    """SIGKILL every process below this one; their pids."""
    me, killed = os.getpid(), []
    for pid in procs.descendants(me):
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


class Forwarder:
    """Signal handlers that pass SIGTERM/SIGINT on to torchrun, remembering the first, and end everything
    `stop_s` after it.

    Only the first is passed on: torchrun's agent answers every SIGTERM by raising in whatever it is
    doing, so a second one (a VM shutting down signals us and torchrun at once, and we forward) cuts
    short its wait for the workers' save and leaves them to die with this container."""

    def __init__(self, stop_s: float = STOP_S) -> None:
        self.child: int | None = None
        self.started = False  # torchrun is being started or runs: a signal must reach it, not end us
        self.done = False  # torchrun was reaped: its pid may belong to someone else now
        self.received: int | None = None
        self.forwarded: int | None = None
        self.stop_s, self.deadline = stop_s, float("inf")
        self.timer: threading.Timer | None = None  # ends everything at the stop deadline
        self.stopped = threading.Event()  # set by the first signal: a node-local hold ends with it
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        if self.received is not None:
            return
        self.received, self.deadline = signum, time.monotonic() + self.stop_s
        self.stopped.set()
        name = signal.Signals(signum).name
        if not self.started:
            _say(f"{name} before torchrun started: nothing to save, exit {exit_codes.killed_by(signum)}")
            os._exit(exit_codes.killed_by(signum))
        what = "torchrun has ended" if self.done else "passed on to torchrun (the workers save at their next step)"
        _say(f"{name}: {what}; everything ends within {self.stop_s:.0f}s")
        self.timer = threading.Timer(self.stop_s, self._stop_deadline)
        self.timer.daemon = True
        self.timer.start()
        self.forward()

    def forward(self) -> None:
        if self.child is not None and self.received is not None and not self.done and self.forwarded is None:
            try:
                os.kill(self.child, self.received)
                self.forwarded = self.received
            except ProcessLookupError:
                pass

    def _stop_deadline(self) -> None:
        killed = kill_descendants()
        if killed:
            _say(f"still running {self.stop_s:.0f}s after the signal: killed {len(killed)} process(es)")


def _reap_until(pid: int) -> int:
    """The child's exit code; reaps every orphan that is handed to us meanwhile."""
    while True:
        reaped, status = os.waitpid(-1, 0)
        if reaped == pid:
            return os.waitstatus_to_exitcode(status)


def drain(end: float) -> int:
    """Reap the container's remaining processes until none is left or `end` (monotonic); then SIGKILL
    them. Returns how many had to be killed."""
    killed = 0
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0]:
                continue
        except ChildProcessError:
            return killed
        now = time.monotonic()
        if now >= end and not killed:
            killed = len(kill_descendants()) or 1
            _say(f"killed {killed} process(es) still running after torchrun (at most {DRAIN_S:.0f}s, or the stop "
                 "deadline)")
        if now >= end + _KILL_WAIT_S:
            return killed
        time.sleep(0.05)  # a bounded poll of our own children, at most DRAIN_S long


def exit_code(code: int, forwarded: int | None, finished: bool) -> int:
    """The pod's exit code from torchrun's, the signal passed on to torchrun while it ran (None: none)
    and whether the job finished. A stop we passed on ends as 128+N whatever torchrun made of it (1 from
    its SignalException, 0 from workers that stopped, 137 from our own stop deadline), so that the Job's
    policy reads a stop as a stop; a configuration mistake (78) keeps its code."""
    code = exit_codes.killed_by(-code) if code < 0 else code
    if forwarded is None:
        return code
    if finished:
        return exit_codes.OK
    return code if code == exit_codes.PERMANENT else exit_codes.killed_by(forwarded)


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


def _stop_s() -> float:
    value = os.environ.get(POD_STOP_ENV, "")
    try:
        return float(value) if value else STOP_S
    except ValueError:
        raise UserError(f"${POD_STOP_ENV}={value!r} is not a number of seconds") from None


def run(argv: list[str]) -> int:
    forwarder = Forwarder(_stop_s())  # first: a SIGTERM during the checks below must end us, not be lost
    procs.become_subreaper()
    if "-m" not in argv:
        raise UserError("expected torchrun's arguments, then -m MODULE and its flags")
    module = argv[argv.index("-m") + 1]
    launch = parse_launch(argv)
    from elastic_mnist.config import parse_args

    config = parse_args(launch.train_args)
    verdict = _verdict(launch, config)
    if verdict is not None:
        return verdict
    forwarder.started = True
    torchrun_args = argv[:argv.index("-m")]
    if launch.backend == "etcd-v3":
        torchrun_args = rate_limited(torchrun_args)
    child = subprocess.Popen(procs.torchrun_command(torchrun_args, launch.train_args, module),
                             env=procs.child_env(), preexec_fn=procs.die_with_parent_preexec(signal.SIGTERM))
    forwarder.child = child.pid
    forwarder.forward()  # a signal that arrived while Popen started torchrun
    code = _reap_until(child.pid)
    forwarder.done, child.returncode = True, code  # reaped by us: keep Popen from waiting again
    drain(min(time.monotonic() + DRAIN_S, forwarder.deadline))
    if code != 0 and forwarder.forwarded is None:
        verdict = _verdict(launch, config)
        if verdict is not None:
            return verdict
        if code == exit_codes.NODE_LOCAL:  # this node gave up; the job goes on without it
            hold_node_local(lambda line: print(line, flush=True), "elastic-mnist pod", forwarder.stopped)
    finished = forwarder.forwarded is not None and finished_line(config.checkpoint_dir, config.max_steps) is not None
    return exit_code(code, forwarder.forwarded, finished)


def rate_limited(torchrun_args: list[str]) -> list[str]:
    """torchrun's flags with --max-restarts at POD_MAX_RESTARTS (every spelling torchrun takes)."""
    out, skip = [], False
    for arg in torchrun_args:
        if skip:
            skip = False
        elif arg in ("--max-restarts", "--max_restarts"):
            skip = True
        elif not arg.startswith(("--max-restarts=", "--max_restarts=")):
            out.append(arg)
    return [*out, f"--max-restarts={POD_MAX_RESTARTS}"]


def main(argv: list[str] | None = None) -> int:
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        print(f"elastic-mnist pod: error: {e}", flush=True)
        return exit_codes.PERMANENT


if __name__ == "__main__":
    sys.exit(main())
