"""Checkpoint policy under sharded training (--parallel fsdp): the same owner as state/manager.py's, with
every rank holding only its rows.

    torchrun --nproc-per-node 2 -m elastic_mnist.train --parallel fsdp --data-dir ../shared/data --max-steps 50

A round agrees on its state in this order: the newest state its ranks hold in memory (state/sharded_sync.py:
every rank's rows of the last two steps, and a copy of its ring predecessor's, moved to the new world size),
unless a checkpoint is newer; then the newest checkpoint that verifies (a sharded one read through DCP at
this size, or a replicated run's); else a fresh run. After every step each rank keeps its rows (the `Keeper`),
so a lost rank's rows are in a survivor's memory. Checkpoints are collective DCP saves: every rank writes its
rows, global rank 0 publishes the file that makes the step exist, then prunes to --keep-checkpoints.

Not here, because a rank holds only its rows: a survivor alone cannot save the state when a peer is lost (the
next round's survivors move it in memory; a process that ends takes its rows with it, and the newest
checkpoint stays); and the in-memory snapshots under --snapshot-dir (the `Keeper` takes their place).
"""

from __future__ import annotations

import time

from elastic_mnist.state import fence, sharded_files
from elastic_mnist.state import format as checkpoint
from elastic_mnist.state import sync as state_sync
from elastic_mnist.state.manager import LIVE_TEMP_S, CheckpointManager, Held
from elastic_mnist.state.registry import OBJECTS_KEY, Progress, Stateful
from elastic_mnist.state.sharded_sync import Keeper, agree_sharded
from elastic_mnist.state.writer import prune


class ShardedCheckpoints(CheckpointManager):
    """`shards`: the round's learner as rows and the rest (worker/sharded.py's ShardedState)."""

    saves_alone = False  # a rank holds its rows only: the ranks save together or not at all

    def __init__(self, config, env, metrics, fingerprint: dict, key: bytes | None, shards) -> None:
        super().__init__(config, env, metrics, fingerprint, key)
        self.shards = shards
        self.keeper: Keeper | None = None
        self._saved_step = -1
        self._phases: dict[str, float] = {}  # the restore's parts, in the resume record

    # -- restore ----------------------------------------------------------------------------------
    def restore(self, objects: dict[str, Stateful], progress: Progress, steps_per_epoch: int,
                memory: Held | None = None) -> None:
        """Collective, as the replicated manager's."""
        self.objects, self.progress, self.steps_per_epoch = objects, progress, steps_per_epoch
        self._sweep_snapshots()
        if self.writes:
            sharded_files.sweep_temps(self.config.checkpoint_dir, LIVE_TEMP_S)
        device, started = next(self.shards.model.parameters()).device, time.perf_counter()
        moved = agree_sharded(list(memory.kept) if memory else [], self.env.rank, self.env.world_size, device,
                              self.key)
        self._phases = {"reshard_s": time.perf_counter() - started}
        # Every rank now holds the moved state alike: the agreement over files reads only newer ones.
        agreed = Held(moved.step, moved.lineage, {}, self.env.world_size) if moved else None
        state, source, self.lineage = self._agree_on_state(agreed)
        if self.writes:
            self._token = self.writer.if_room(lambda: fence.claim_generation(self.config.checkpoint_dir,
                                                                       self.env.world_size, self.lineage)) or ""
        self._phases["files_s"] = time.perf_counter() - started - self._phases["reshard_s"]
        self._load(moved, state, source)
        self.keeper = Keeper(self.lineage, self.env.rank, self.env.world_size)
        # What this rank kept of the last round stays until this round keeps its own two steps: a peer lost
        # before then leaves the state this round started from in memory, as it was, at no cost to the change.
        self.keeper.steps = [k for k in (memory.kept if memory and source == state_sync.MEMORY else ())
                             if (k.offer.lineage, k.offer.step) == (moved.lineage, moved.step)]

    def _load(self, moved, state: dict | None, source: str) -> None:
        progress, env = self.progress, self.env
        if source == state_sync.MEMORY:
            loading = time.perf_counter()
            self.shards.load(moved.rows, moved.replicated)
            self._phases["load_s"] = time.perf_counter() - loading
            progress.step = moved.step
            progress.resumes += 1
            self.metrics.event("resume", f"[resume] step {progress.step} in place (sharded, moved in memory: "
                               f"{moved.sent} bytes sent by this rank); now world size {env.world_size}, torchrun "
                               f"restart {env.restart_count}", step=progress.step, source=source, in_place=True,
                               sent_bytes=moved.sent, **{k: round(v, 3) for k, v in self._phases.items()})
            return
        if state is None:  # nothing anywhere: the run starts over, its progress too
            progress.load_state_dict(Progress().state_dict())
            progress.step = 0
            self.shards.load_initial()
            self.metrics.event("start", f"[start] fresh sharded run at world size {env.world_size} (no checkpoint "
                               f"in {self.config.checkpoint_dir})", world_size=env.world_size)
            return
        if sharded_files.SHARDS_KEY in state:
            made = {}

            def make(listed):
                made["rows"], views = self.shards.rows_for(listed)
                return views

            sharded_files.load_listed(self.config.checkpoint_dir, state, make)
            self.shards.load(made["rows"], state)
        else:
            self.shards.load_replicated(state)
        progress.step = state["step"]
        progress.resumes += 1
        self.metrics.event(
            "resume", f"[resume] step {state['step']} from {source}, saved at world size {state['world_size']}; "
            f"now world size {env.world_size} (sharded), torchrun restart {env.restart_count}", step=state["step"],
            source=source, saved_world_size=state["world_size"])

    def _encode(self) -> bytes:
        raise AssertionError("a sharded state moves as rows (state/sharded_sync.py), never as one rank's bytes")

    def held(self) -> Held:
        kept = tuple(self.keeper.steps) if self.keeper else ()
        step = kept[0].offer.step if kept else self.progress.step
        return Held(step, self.lineage, {}, self.env.world_size, kept)

    def rollback(self) -> None:
        """Nothing to do: the next round loads what the keeper holds, never the live rows."""

    # -- keep and save ----------------------------------------------------------------------------
    def confirm_step(self) -> None:
        """Collective: every rank finished the step; each keeps its rows and copies them to its ring successor."""
        rows, rest = self.shards.split()
        self.keeper.advance(self.progress.step, rows, self.shards.specs(), rest)

    def after_step(self, epoch_end: bool) -> bool:
        step, cfg = self.progress.step, self.config
        if not (epoch_end or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
            return False
        # Every rank saves or none: rank 0 (which holds the fence's token) decides for all.
        owned = not self._token or fence.generation_is(cfg.checkpoint_dir, self._token) if self.writes else True
        if not state_sync.broadcast_bytes(b"1" if owned else b"", 0):
            if self.writes:
                self.metrics.warn(f"a newer group owns {cfg.checkpoint_dir}; this one stops to rejoin it")
            return True
        self._save()
        return False

    def _save(self) -> None:
        """Collective: a DCP save of every rank's rows and the published file; a volume that cannot take it is
        one warning (training goes on, the rows stay in memory)."""
        step, t0 = self.progress.step, time.perf_counter()
        rest = self._rest_of(step)
        epoch, position = divmod(step, self.steps_per_epoch)
        state = {"epoch": epoch, "position": position, **rest, OBJECTS_KEY: sorted(rest), **self._envelope()}
        try:
            sharded_files.save(self.config.checkpoint_dir, step, self.shards.saved(), state, self.key)
        except Exception as e:  # noqa: BLE001 - DCP raises its ranks' write errors on every rank alike
            self.unsaved = f"the checkpoint of step {step} failed: {str(e).splitlines()[0][:200]}"
            self.metrics.warn(f"{self.unsaved}; training goes on (the state stays in the ranks' memory)")
            return
        self.unsaved, self._saved_step = "", step
        if self.writes:
            prune(self.config.checkpoint_dir, self.config.keep_checkpoints,
                  protect=checkpoint.path_for(self.config.checkpoint_dir, step))
        block_ms = (time.perf_counter() - t0) * 1000
        if self.writer is not None:
            self.writer.block_ms.append(block_ms)
            self.writer.saved += 1
        self.metrics.scalars(step, {"checkpoint/block_ms": block_ms})

    def _rest_of(self, step: int) -> dict:
        """The replicated rest of `step` as the keeper took it at the step's end: what a resume from memory
        loads, so one from this checkpoint loads the same (an evaluation since may have drawn from the RNG)."""
        kept = self.keeper.steps[0] if self.keeper and self.keeper.steps else None
        ours = kept is not None and kept.offer.step == step and kept.offer.lineage == self.keeper.lineage
        return kept.replicated if ours else self.shards.split()[1]

    def _envelope(self) -> dict:
        return {"config": self.config.to_dict(), "fingerprint": self.fingerprint, "world_size": self.env.world_size,
                "run_id": self.env.run_id, "origin": self.snapshot.origin, "saved_at": time.time()}

    def save_on_failure(self) -> str:
        return ""  # every rank's rows are needed: what survives is in the survivors' memory, else the newest checkpoint

    def finish(self, superseded: bool) -> None:
        """Collective: the last step saved unless it is already, or a newer group owns the dir."""
        if not superseded and self._saved_step != self.progress.step:
            self._save()
