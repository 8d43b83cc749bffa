"""The one owner of checkpoint policy: what is saved, when, where, who writes, and how it is restored.

    python -m elastic_mnist.train --data-dir ../shared/data --checkpoint-dir ckpt --checkpoint-every 100

Built once per (re)start by worker/train.py's build_trainer; the trainer asks it (`after_step`, `save_on_failure`,
`finish`) and never assembles a checkpoint itself. It owns the durable writer (--checkpoint-dir), the in-memory
snapshot writer (--snapshot-dir), the split-brain fence, the snapshots' origin and lifetime, the
configuration fingerprint, and the save/restore of the registered state objects (state/registry.py:
model, optimizer, scheduler, scaler, RNG, the task's own, progress).
File format, verification and publishing live in state/format.py; the
cross-rank agreement in state/sync.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from elastic_mnist import volume
from elastic_mnist.compat import private as compat
from elastic_mnist.config import TrainConfig
from elastic_mnist.contract.errors import NodeLocalError, UserError
from elastic_mnist.distributed import DistEnv
from elastic_mnist.metrics import Metrics, percentile
from elastic_mnist.state import fence, snapshots
from elastic_mnist.state import format as checkpoint
from elastic_mnist.state import sync as state_sync
from elastic_mnist.state.registry import OBJECTS_KEY, Progress, Stateful, cpu_snapshot, leaves, load_into, map_tensors
from elastic_mnist.state.snapshotter import Snapshotter
from elastic_mnist.state.writer import CheckpointWriter, Verifier, refuse_foreign

# The objects whose tensors make up most of a snapshot (its size estimate before the first one).
_ON_DEVICE = ("model", "optimizer")
_SHARD_RETRIES = 4  # sharded checkpoints passed over for shards that do not verify, before the restore gives up
# A temp file in the checkpoint dir younger than this may be another writer's save in progress.
LIVE_TEMP_S = 600.0


def check_checkpoint_dir(config: TrainConfig) -> None:
    """This node's --checkpoint-dir can take the saves of its writers: writable (else NodeLocalError: this node's
    disk or mount; full or read-only is one warning later, training goes on: volume.py), and no other program's
    file under a checkpoint name (refuse_foreign): this node's own with node-local storage, every node's on a
    shared volume."""
    try:
        checkpoint.ensure_writable(config.checkpoint_dir)
    except OSError as e:
        if volume.room_error(e) is None:
            raise
    refuse_foreign(config.checkpoint_dir, NodeLocalError if config.checkpoint_storage == "local" else UserError)


@dataclass(frozen=True)
class Held:
    """The state a worker kept across rounds holds between them (its objects are the state itself)."""

    step: int
    lineage: str
    """The generation token of the round that agreed on it: every survivor of that round holds the same."""
    rng: dict
    """The RNG as the round ended (forming the next round's groups may draw from it)."""
    world_size: int
    kept: tuple = ()
    """Sharded training: this rank's rows of the round's last steps (state/sharded_sync.py's Keeper.steps)."""


class CheckpointManager:
    saves_alone = True
    """Any rank can save the whole state by itself (at its node's end, on a peer's loss)."""

    def __init__(self, config: TrainConfig, env: DistEnv, metrics: Metrics, fingerprint: dict,
                 key: bytes | None = None):
        self.config, self.env, self.metrics, self.fingerprint, self.key = config, env, metrics, fingerprint, key
        # Shared storage: global rank 0 writes. Node-local storage: every rank keeps its own copy.
        self.writes = env.rank == 0 or config.checkpoint_storage == "local"
        self.snapshot = snapshots.place(config.snapshot_dir, env.run_id, env.local_rank, config.checkpoint_dir,
                                        enabled=env.launched and config.snapshot_every > 0)
        self.writer = self._durable_writer() if self.writes else None
        self.snapshots = Snapshotter(config.snapshot_dir, self.snapshot, key, metrics)
        self._token = ""
        self.objects: dict[str, Stateful] = {}
        self.progress = Progress()
        self.steps_per_epoch = 1
        self._confirmed: dict | None = None
        """A copy of every registered object's state at the last step every rank finished (see confirm_step)."""
        self._confirmed_tensors: list | None = None
        self._confirmed_step = -1
        self._keeps_copy = False
        self.lineage = ""
        self.unsaved = ""
        """Set when the final save found the checkpoint volume full or read-only: where the state is instead."""

    # -- restore ----------------------------------------------------------------------------------
    def restore(self, objects: dict[str, Stateful], progress: Progress, steps_per_epoch: int,
                memory: Held | None = None) -> None:
        """Collective: every rank offers its newest valid state (`memory`: what its objects hold from the round
        before, in a worker kept across rounds), the newest wins and is loaded into every registered object,
        and `progress`, in place; a rank whose memory won loads nothing. A fresh run is the case with no state.
        Safe to repeat. `objects` must hold "model" and "optimizer" (the failure-state copy is theirs)."""
        self.objects, self.progress, self.steps_per_epoch = objects, progress, steps_per_epoch
        mode, on_gpu = self.config.failure_state, next(objects["model"].parameters()).device.type == "cuda"
        self._keeps_copy = mode == "copy" or (mode == "auto" and on_gpu)  # decided once, not per step
        self._sweep_snapshots()
        state, source, self.lineage = self._agree_on_state(memory)
        if self.writes:  # this group now owns every dir it writes to (see fence.claim_generation)
            self._token = self.writer.if_room(lambda: fence.claim_generation(self.config.checkpoint_dir,
                                                                       self.env.world_size, self.lineage)) or ""
        if source == state_sync.MEMORY:
            objects["rng"].load_state_dict(memory.rng)  # as it was at the end of the round: the group's set-up drew
            progress.resumes += 1
            self.metrics.event("resume", f"[resume] step {progress.step} in place (kept in memory); now world size "
                               f"{self.env.world_size}, torchrun restart {self.env.restart_count}", step=progress.step,
                               source=source, saved_world_size=memory.world_size, in_place=True)
            return
        if state is None:
            self.metrics.event("start", f"[start] fresh run at world size {self.env.world_size} "
                               f"(no checkpoint in {self.config.checkpoint_dir})", world_size=self.env.world_size)
            return
        if checkpoint.SHARDS_KEY in state:  # a sharded run's checkpoint: its rows read whole, here
            from elastic_mnist.state.sharded_files import read_whole

            state = read_whole(self.config.checkpoint_dir, state)
        load_into({**objects, "progress": progress}, state, source)
        progress.step = state["step"]
        progress.resumes += 1
        self.metrics.event(
            "resume", f"[resume] step {state['step']} (epoch {state['epoch']}, position {state['position']}) from "
            f"{source}, saved at world size {state['world_size']}; now world size {self.env.world_size}, "
            f"torchrun restart {self.env.restart_count}", step=state["step"], source=source,
            saved_world_size=state["world_size"])

    def _agree_on_state(self, memory: Held | None) -> tuple[dict | None, str, str]:
        """(the agreed state or None, where it came from, rank 0's generation token for this group). A sharded
        run's checkpoint whose shards do not verify is set aside, as a file that does not verify is, and the
        ranks agree again on the one before it."""
        for _ in range(_SHARD_RETRIES):
            state, source, token = self._agree_once(memory)
            if state is None or checkpoint.SHARDS_KEY not in state:
                return state, source, token
            from elastic_mnist.state.sharded_files import shards_problem

            problem = shards_problem(self.config.checkpoint_dir, state, self.env.world_size)
            if not problem:
                return state, source, token
            if self.writes:
                Verifier(self.key, self.metrics.warn).set_aside(source, problem)
            state_sync.agree_errors(None, self.env.world_size)  # every rank looks again once it is aside
        raise UserError(f"the newest {_SHARD_RETRIES} sharded checkpoints in {self.config.checkpoint_dir} have shards "
                        "that do not verify and stay where they are: move them out of the directory")

    def _agree_once(self, memory: Held | None) -> tuple[dict | None, str, str]:
        config, env, error, mine = self.config, self.env, None, None
        held = None if memory is None else state_sync.held(memory.step, memory.lineage, self._encode)
        try:
            if self.writes:
                self.writer.if_room(lambda: checkpoint.ensure_writable(config.checkpoint_dir))
                refuse_foreign(config.checkpoint_dir,
                               NodeLocalError if config.checkpoint_storage == "local" else UserError)
                checkpoint.refuse_other_key(config.checkpoint_dir, self.key)
            mine = state_sync.best_local(config.checkpoint_dir, self.snapshots.readable, self.snapshot.origin,
                                         self.metrics.warn, self.key, held)
        except UserError as e:
            error = e
        state_sync.agree_errors(error and str(error), env.world_size, isinstance(error, NodeLocalError))
        offered = fence.new_token() if env.rank == 0 else ""
        chosen, owner, sent_to, token = state_sync.agree_on_state(mine, env.rank, env.world_size, offered)
        if sent_to:
            self.metrics.event("sync", f"[sync] step {chosen.step}: rank {owner} sent its state to ranks {sent_to}",
                               step=chosen.step, owner=owner, sent_to=sent_to)
        if chosen is None or chosen.source == state_sync.MEMORY:
            return None, "" if chosen is None else chosen.source, token
        # Decoded once: a local state when it was verified; what a peer sent, here (its checksum too).
        state = chosen.state if chosen.state is not None else checkpoint.decode(chosen.blob, chosen.source, self.key)
        checkpoint.check_compatible(state, self.fingerprint, chosen.source)
        if self.writes:
            self.writer.if_room(lambda: state_sync.keep_durable_copy(chosen, config.checkpoint_dir))
        return state, chosen.source, token

    def held(self) -> Held:
        """What this process's objects hold at the end of a clean round (agreed by every rank of it)."""
        return Held(self.progress.step, self.lineage, self.objects["rng"].state_dict(), self.env.world_size)

    def rollback(self) -> None:
        """After a lost peer on a device that runs ahead (failure state "copy"): the objects get the copy of the
        last step every rank confirmed back, so the process goes on from an agreed step, never a half-run one."""
        if self._confirmed is None:
            return
        load_into(self.objects, self._confirmed, "the copy of the last confirmed step")
        self.progress.step = self._confirmed_step

    def _encode(self) -> bytes:
        """This process's state as a checkpoint's bytes, for a peer that lacks it."""
        return checkpoint.encode(self.capture(), self.key)

    def _sweep_snapshots(self) -> None:
        if self.writes:  # temp files of writers killed mid-write (the age leaves a live writer's alone)
            snapshots.sweep_temps(self.config.checkpoint_dir, min_age_s=LIVE_TEMP_S)
        if not self.snapshots.readable:
            return
        removed = snapshots.sweep(snapshots.root_of(self.config.snapshot_dir), self.snapshot.run_root,
                                  self.config.snapshot_max_age_h * 3600, self.config.snapshot_cap_mb * 2**20)
        if removed:
            self.metrics.event("snapshots_swept", f"[snapshots] removed {len(removed)} stale snapshot dir(s) of other "
                               "runs", removed=removed)

    # -- save -------------------------------------------------------------------------------------
    def confirm_step(self) -> None:
        """Every rank finished the current step. A GPU runs ahead of the host: when a peer is lost, kernels
        queued behind an aborted collective may still run on garbage, so the failure save uses this copy
        (device-to-device, no host sync) of the last confirmed step instead of the live state. Every
        registered object is copied, not only model and optimizer: the scheduler, scaler, RNG and the
        task's own state must describe the same step as the weights."""
        if not self._keeps_copy:
            return
        live = {name: obj.state_dict() for name, obj in self.objects.items()}
        tensors, kept = leaves(live), self._confirmed_tensors
        if kept is None or len(kept) != len(tensors) or any(a.shape != b.shape for a, b in zip(kept, tensors)):
            kept = self._confirmed_tensors = [t.detach().clone() for t in tensors]  # first step, or new state
        else:
            compat.foreach_copy_(kept, tensors)
        copies = iter(kept)
        # The same structure with the copies in place of the live tensors (numbers are values already).
        self._confirmed = map_tensors(live, lambda _t: next(copies))
        self._confirmed_step = self.progress.step

    def capture(self, confirmed: bool = False) -> dict:
        """The whole training state as CPU copies a writer thread may serialize: at the current step, or
        (confirmed) at the last step every rank finished, where a device copy is kept."""
        step = self.progress.step
        parts = {name: obj.state_dict() for name, obj in {**self.objects, "progress": self.progress}.items()}
        if confirmed and self._confirmed is not None:
            step = self._confirmed_step
            parts.update(self._confirmed)
        epoch, position = divmod(step, self.steps_per_epoch)
        return cpu_snapshot({
            "step": step, "epoch": epoch, "position": position, **parts, OBJECTS_KEY: sorted(parts),
            "config": self.config.to_dict(), "fingerprint": self.fingerprint, "world_size": self.env.world_size,
            "run_id": self.env.run_id, "origin": self.snapshot.origin, "saved_at": time.time(),
        })

    def after_step(self, epoch_end: bool) -> bool:
        """Save what is due at this step; True when a newer group owns the checkpoint dir (this group
        must stop at the next agreement without writing)."""
        step, cfg = self.progress.step, self.config
        checkpoint_due = epoch_end or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
        if cfg.snapshot_every and step % cfg.snapshot_every == 0 and not checkpoint_due:
            # (a checkpoint of the same step would make the snapshot redundant)
            self.snapshots.take(self.capture, step, self._state_bytes)
        if self.writer is None or not checkpoint_due:
            return False
        if self._token and not fence.generation_is(cfg.checkpoint_dir, self._token):
            self.metrics.warn(f"a newer group owns {cfg.checkpoint_dir}; this one stops to rejoin it")
            return True
        self._save(block=False)
        return False

    def _save(self, block: bool) -> None:
        t0 = time.perf_counter()
        self.writer.save(self.capture(), self.progress.step, block=block)
        if not block:  # a blocking save happens only when leaving, not while training
            block_ms = (time.perf_counter() - t0) * 1000
            self.writer.block_ms.append(block_ms)
            self.metrics.scalars(self.progress.step, {"checkpoint/block_ms": block_ms})

    def save_on_failure(self) -> str:
        """A peer died mid-step: this rank still holds the state of its last completed step, so any
        survivor may persist it; the no-clobber publish makes the first survivor's copy win. Not
        fenced: a newer group only ever holds newer steps, and names never overwrite."""
        if self.writer is not None:
            try:
                self.writer.wait()
            except RuntimeError as e:
                self.metrics.warn(f"in-flight checkpoint write failed: {e}")
        writer = self.writer or self._durable_writer()
        state = self.capture(confirmed=True)
        writer.save(state, state["step"], block=True)
        if writer.held_step >= state["step"]:
            return writer.last_path or "already saved by another survivor"
        kept = self.snapshots.keep(state, state["step"])  # the checkpoint volume is full or read-only
        if not kept:
            raise RuntimeError(f"{self.config.checkpoint_dir} cannot be written, nor a snapshot of step "
                               f"{state['step']}")
        return f"{kept}, an in-memory snapshot: {self.config.checkpoint_dir} cannot be written"

    def finish(self, superseded: bool) -> None:
        """Leaving the loop (done or stopping): save the last step unless a newer group owns the dir. A save
        the checkpoint volume cannot take goes into an in-memory snapshot (`unsaved` says where)."""
        if self.writer is None:
            return
        if superseded:
            self.writer.wait()  # an earlier save still in flight is ours to finish
            return
        self._save(block=True)
        step = self.progress.step
        if self.writer.held_step < step:
            kept = self.snapshots.keep(self.capture(), step)
            self.unsaved = f"it stays in the in-memory snapshot {kept}" if kept else "no snapshot could hold it"

    def mark_finished(self, summary: dict, unsaved: bool = False) -> None:
        """Training completed: record it for late nodes (and pods) and free this job's snapshots; unless the
        final state of some rank is not in a checkpoint (`unsaved`): then every snapshot stays, for the
        restart that writes it."""
        if unsaved:
            self.close()
            return
        if self.env.rank == 0:
            self.writer.if_room(lambda: fence.write_finished(self.config.checkpoint_dir, {
                "step": summary["global_step"], "total_steps": summary["total_steps"],
                "test_accuracy": summary["test_accuracy"], "run_id": self.env.run_id, "time": time.time()}))
        self.close()
        self.snapshots.remove()

    def close(self) -> None:
        """Wait for writes in flight, check how the last one went, end the writers' threads (safe to repeat)."""
        if self.writer is not None:
            self.writer.wait()
            self.writer.close()
        self.snapshots.close()

    def _durable_writer(self) -> CheckpointWriter:
        return CheckpointWriter(self.config.checkpoint_dir, self.config.keep_checkpoints, self.key,
                                warn=self.metrics.warn)

    def _state_bytes(self) -> int:
        """What the device state of a snapshot weighs (before the first one says it exactly)."""
        return sum(t.numel() * t.element_size() for t in leaves({n: self.objects[n].state_dict() for n in _ON_DEVICE}))

    def stats(self) -> dict:
        block = self.writer.block_ms if self.writer else []
        return {
            "checkpoints_saved": self.writer.saved if self.writer else 0,
            "checkpoint_block_ms_mean": sum(block) / len(block) if block else 0.0,
            "checkpoint_block_ms_p50": percentile(block, 50), "checkpoint_block_ms_p95": percentile(block, 95),
            "checkpoint_block_ms_max": max(block) if block else 0.0,
            "snapshots_taken": len(self.snapshots.block_ms),
            "snapshot_block_ms_p50": percentile(self.snapshots.block_ms, 50),
        }
