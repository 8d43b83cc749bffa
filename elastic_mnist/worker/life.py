"""The life of a worker process, in one place: build, then round after round (attach, round start, round end),
then its node's end.

    torchrun --rdzv-backend=etcd-v3 ... -m elastic_mnist.train ...   # rounds in place (the backend's default)
    torchrun --rdzv-backend=c10d ... -m elastic_mnist.train ...      # one round per process

A worker builds once (worker/build.py: device, data, model, optimizer, the task's state) and then trains
rounds. torchrun starts a process for every round; under etcd-v3 with in-place rounds that process only stands
in for this one (its session: contract/kept.py). At the end of a round this process tears down its process
groups, its stand-in exits, and it waits for the next round's stand-in, keeping everything it built and the
state it trained. The next round agrees on the newest state with its peers; its own memory counts as a state
at its last agreed step, and nothing is decoded when that wins. Elsewhere a process lives one round, as
torchrun expects.

How a round ends, and what its stand-in exits with:
  done .............................................. 0; the process ends
  a stop asked of this node (SIGTERM) ............... 0; kept: waits (its agent restarts, or ends it)
  a peer's stop, a newer group, no group formed ...... 75 (torchrun forms the next round); kept: waits
  another node's own problem as the round starts ...... 75 (its node ends, exit 69); kept: waits
  a peer lost in a collective ........................ kept: 75, waits, from its last agreed step;
                                                      else: saved, 75, the process ends (worker/failure.py)
A kept process ends when its node does (its agent ends: it saves what it holds where a restart finds it), when
no round comes within --round-timeout (the same), or on a fallback: a teardown that failed, a round it cannot
take. It then saves and exits, and torchrun's next start of this rank is a fresh process. Each fallback is one
line on stderr and a "fallback" record in the journal.
"""

from __future__ import annotations

import gc
import io
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass

import torch

from elastic_mnist import distributed, graveyard
from elastic_mnist.compat import private as compat
from elastic_mnist.contract import exit_codes, kept
from elastic_mnist.contract.errors import NodeLocalError, PeerNodeLocalError
from elastic_mnist.metrics import process_age_s
from elastic_mnist.runlog import RunLog, say
from elastic_mnist.state import format as checkpoint
from elastic_mnist.state.manager import CheckpointManager
from elastic_mnist.state.registry import cpu_snapshot
from elastic_mnist.usage import steady_heap, trim_heap, usage
from elastic_mnist.worker.build import Process, build_process, build_round
from elastic_mnist.worker.control import ControlPlane
from elastic_mnist.worker.control import threads_ended as control_threads_ended
from elastic_mnist.worker.devicefault import device_fault
from elastic_mnist.worker.fault_points import FaultPoints
from elastic_mnist.worker.phase import Phase
from elastic_mnist.worker.stop import StopRequest
from elastic_mnist.worker.task import Task
from elastic_mnist.worker.trainer import Trainer

RELEASE_WAIT_S = 0.5  # a round's threads and groups, let go of at its end, take milliseconds to go


@dataclass(frozen=True)
class Ending:
    code: int
    """What this round's stand-in (or the process) exits with."""
    goes_on: bool
    """Whether a kept process may serve the next round."""
    lost: bool = False
    """A peer was lost: the round's groups are given up, not closed."""


class Life:
    def __init__(self, config, task: Task, stop: StopRequest, marks: dict) -> None:
        self.config, self.task, self.stop, self.marks = config, task, stop, marks
        self.session = kept.session()
        self.proc: Process | None = None
        self.faults: FaultPoints | None = None  # tests' injected failures (fault_points.py), from the first round
        self.last: CheckpointManager | None = None  # the last round's: it saves what the process holds at its end
        self.env: distributed.DistEnv | None = None  # the last round's place in the job
        self.phase = Phase.STARTING  # this worker's one phase: only this class sets it (worker/phase.py)
        stop.phase = lambda: self.phase

    def run(self) -> int:
        self._build()
        while True:
            if self.session is not None and not self.session.attached:
                what, why = self.session.wait(self.config.round_timeout, lambda: self.stop.requested)
                if what is not kept.Wake.ATTACH:
                    return self._node_end(what, why)
                self.marks = {}
            self.phase = Phase.FORMING
            ending = self._round()
            if self.session is None:
                return ending.code
            if not ending.goes_on:  # an orphan's stop, say: what the round left in memory goes to disk first
                self._save_held()
                return ending.code
            problem = self._round_end(ending)
            if problem:
                return self._fall_back(problem, ending.code)

    def _build(self) -> None:
        """Once per process; a stop meanwhile ends it at once (nothing is loaded yet)."""
        local_rank, local_world = distributed.read_local()
        steady_heap()  # before the rounds' large blocks come and go (usage.py)
        with self.stop.leave_at_once("during the worker's start-up"):
            pay_startup_cost(self.config.startup_cost, self.stop)
            self.marks["startup_cost"] = time.time()
            device = distributed.pick_device(self.config.backend, local_rank, local_world)
            self.proc = build_process(self.config, self.task, device, self.marks)
        gc.freeze()  # what the build made lives as long as the process: the collections at round ends skip it
        if self.session is not None and not self.session.attached:
            self.session.ready()  # built before its round: the agent may join

    def _round(self) -> Ending:
        config, env = self.config, distributed.read_env()
        self.env = env
        if self.faults is None:
            self.faults = FaultPoints(env.rank, self._step())
        now = time.time()  # its stand-in: where torchrun started this round's process (warm/kept.py)
        self.proc.marks = {**self.marks, "stand_in": now - process_age_s(), "attached": now}
        # Until the state is agreed, a stop has nothing new to save: a process holding an earlier round's state
        # saves that first, any other exits at once (the newest state is in its files or with its peers). This
        # spares torchrun's 30 s wait on a worker forming a group with peers that are leaving. A process that
        # can serve another round waits for its peers in the muster, where a stop ends the round, not it.
        kept = self.session is not None
        try:
            with nullcontext() if kept else self.stop.leave_at_once("before the process group formed"):
                store = distributed.muster(env, config.connect_timeout, lambda: self.stop.requested,
                                           lambda: self.faults.reach_muster(env.rank, env.restart_count))
            with self.stop.leave_at_once("before the process group formed", before=self._save_held):
                distributed.init(env, config.backend, config.collective_timeout, config.connect_timeout, store)
        except distributed.StoppedBeforeForming:
            return self._not_formed("a stop came before the process group formed", clean=True,
                                    code=exit_codes.OK, goes_on=not self.stop.orphaned)
        except distributed.GroupFormationError as e:  # nothing trained: torchrun forms the next round
            return self._not_formed(str(e), e.clean, exit_codes.RESTART, goes_on=kept and e.clean)
        self.proc.marks["process_group"] = time.time()
        self.phase = Phase.TRAINING
        with ExitStack() as stack:
            if self.session is None:
                stack.callback(distributed.close)
            config.check_world_size(env.world_size)
            control = ControlPlane(env.world_size, config, self.stop, env.peer_beacons)
            stack.callback(control.leave)
            if config.parallel == "fsdp":
                self.last = None  # the last round's learner goes before this one's is built (a rank's rows)
            try:
                trainer = build_round(self.proc, env, control, stack, in_place=self.session is not None)
            except PeerNodeLocalError as e:  # nothing was loaded: the next round forms without that node
                say(f"elastic-mnist train: {e}")
                return Ending(exit_codes.RESTART, goes_on=self.session is not None)
            self.last = trainer.checkpoints
            return self._train(trainer)

    def _not_formed(self, why: str, clean: bool, code: int, goes_on: bool) -> Ending:
        """The round's group did not form. A process that only mustered is as it was: it serves the next round
        (journaled "round_not_formed"); what torch kept of a group that failed inside its own connect is
        unknown: a fresh process (a fallback)."""
        say(f"elastic-mnist train: {why}; {'this worker waits for' if goes_on else 'exiting for'} torchrun to "
            "form a new round")
        if self.session is not None:
            self._journal("round_not_formed" if clean else "fallback", reason=f"group formation: {why[:200]}",
                          **({"kept": goes_on} if clean else {"saved": ""}))
        return Ending(code, goes_on=goes_on)

    def _train(self, trainer: Trainer) -> Ending:
        try:
            summary = trainer.train()
        except Exception as e:
            fault = device_fault(e)
            if fault:  # this node's GPU: no peer was lost, and its CUDA context can save nothing any more
                raise NodeLocalError(fault) from e
            handled = trainer.handle_failure(e) if trainer.world_size > 1 else None
            if handled is None:
                raise
            step = trainer.progress.step
            if handled.in_place:
                trainer.checkpoints.rollback()  # a device that ran ahead goes back to the last agreed step
                self.proc.held = trainer.checkpoints.held()
                trainer.metrics.event("collective_failed", step=self.proc.held.step, in_place=True)
                trainer.metrics.warn(f"collective failed at step {step} (a peer died or froze): {_first(e)}; state "
                                     f"of step {self.proc.held.step} kept in memory for the next round")
                return Ending(exit_codes.RESTART, goes_on=True, lost=True)
            trainer.metrics.warn(f"collective failed at step {step} (a peer died or froze): {_first(e)}; state "
                                 f"saved ({handled.saved}); exiting for torchrun to restart")
            return Ending(exit_codes.RESTART, goes_on=False)
        if trainer.stopped_early:
            self.proc.held = trainer.checkpoints.held()
            asked = trainer.stop.requested
            return Ending(exit_codes.OK if asked else exit_codes.RESTART, goes_on=not trainer.stop.orphaned)
        return Ending(write_final(self.config, trainer, summary), goes_on=False)

    def _round_end(self, ending: Ending) -> str:
        """The round's groups go; its stand-in exits with the round's code; the stop that ended it is spent.
        "" when this process may serve the next round, else why not."""
        problem = distributed.teardown(abandoned=ending.lost) or self.faults.failure("teardown", self._step())
        if problem:
            return problem
        self.session.detach(ending.code)
        self.phase = Phase.BETWEEN_ROUNDS
        self.stop.spent()
        # The round's objects refer to each other (trainer, its failure handoff, its control plane): only the
        # cycle collector frees them, with their process groups' threads and sockets, and it may not run for
        # many rounds. Now, while the agent forms the next round, rather than never.
        started = time.monotonic()
        control_threads_ended(RELEASE_WAIT_S)
        compat.forget_meshes()
        gc.collect()
        graveyard.drained(RELEASE_WAIT_S)  # what the round let go of is gone before it is counted
        trim_heap()
        self._journal("round_end", code=ending.code, lost=ending.lost, gc_ms=round(1000 * (time.monotonic() - started)),
                      **usage(), **distributed.held_groups())
        return ""

    def _fall_back(self, problem: str, code: int) -> int:
        where = self._save_held()
        self._journal("fallback", reason=problem, saved=where)
        say(f"elastic-mnist train: in-place round end failed ({problem}); state saved ({where}); this worker "
            "exits and its next round starts a fresh one")
        self.session.detach(code)
        return code

    def _node_end(self, what: kept.Wake, why: str) -> int:
        """The node ends (its agent ends), a stop came between rounds, no round came in time, or the round's
        worker is another: what this process holds goes where a restart finds it, then it exits."""
        reason = {kept.Wake.END: why, kept.Wake.STOP: "its agent died (SIGHUP)",
                  kept.Wake.TIMEOUT: f"no new round within --round-timeout {self.config.round_timeout:.0f}s",
                  kept.Wake.REFUSE: f"it cannot serve this round ({why})"}[what]
        where = self._save_held()
        if what is kept.Wake.REFUSE:
            self._journal("fallback", reason=reason, saved=where)
            self.session.refuse(why)
        say(f"elastic-mnist train: leaving ({reason}); {'state saved (' + where + ')' if where else 'nothing held'}")
        return exit_codes.OK

    def _save_held(self) -> str:
        """Save the state this process holds between rounds (any rank may: the publish is no-clobber)."""
        if self.proc is None or self.proc.held is None or self.last is None:
            return ""
        return self.last.save_on_failure()

    def _step(self) -> int:
        return self.proc.learner.progress.step if self.proc is not None and self.proc.learner else -1

    def _journal(self, kind: str, **fields) -> None:
        """A record of this process between rounds, as one of its last round's (whose journal is closed)."""
        env = self.env
        if env is not None:
            with RunLog(self.config.log_dir, "", env.rank, env.world_size, env.restart_count, env.node,
                        self.proc.rounds - 1) as journal:
                journal.event(kind, **fields)


def live(config, task: Task, stop: StopRequest, marks: dict) -> int:
    """The worker, from its flags to its exit code."""
    return Life(config, task, stop, marks).run()


def pay_startup_cost(seconds: float, stop: StopRequest) -> None:
    """--startup-cost: what a GPU job spends once per process (CUDA context, NCCL set-up, model load) that this
    CPU MLP does not, so a replay's recoveries cost what a real job's would. A stop cuts it short."""
    deadline = time.monotonic() + seconds
    while not stop.requested and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.1))


def write_final(config, trainer: Trainer, summary: dict) -> int:
    """The finished run's records and outputs; the exit code. SAVE_FAILED when a final state is not in a
    checkpoint (a full or read-only checkpoint volume): it stays in the in-memory snapshots, which are kept,
    and the restart (torchrun's, or the job's again under its run id) writes it once the volume has room."""
    manager, step = trainer.checkpoints, summary["global_step"]
    manager.mark_finished(summary, unsaved=bool(manager.unsaved))
    if manager.unsaved:
        trainer.metrics.warn(f"the final state (step {step}) is not in {config.checkpoint_dir}, which cannot be "
                             f"written: {manager.unsaved}; exiting {exit_codes.SAVE_FAILED}: a restart with the same "
                             "run id resumes it there and writes it once the volume has room")
    weights = whole_weights(trainer.model)  # collective under sharded training
    if trainer.rank != 0:
        return exit_codes.SAVE_FAILED if manager.unsaved else exit_codes.OK
    buf = io.BytesIO()
    torch.save(cpu_snapshot(weights), buf)
    where = f"in {config.log_dir}/summary.json"
    if not trainer.metrics.write_outputs(buf.getvalue(), summary):
        where = f"not written ({config.log_dir} cannot be written); the trained state is in " + \
            ("the in-memory snapshot" if manager.unsaved else checkpoint.path_for(config.checkpoint_dir, step))
    trainer.metrics.event("done", f"[done] step {step} test_accuracy {summary['test_accuracy']:.4f} samples/s "
                          f"{summary['samples_per_s']:.0f}; summary {where}", step=step,
                          test_accuracy=summary["test_accuracy"])
    return exit_codes.SAVE_FAILED if manager.unsaved else exit_codes.OK


def whole_weights(model: torch.nn.Module) -> dict:
    """The model's state_dict with every tensor whole: a sharded model's rows are gathered (on every rank)."""
    return {name: value.full_tensor() if hasattr(value, "full_tensor") else value
            for name, value in model.state_dict().items()}


def _first(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
