"""Writing checkpoints: one background thread, verified publishing, and a prune that trusts only content.

    python -c "from elastic_mnist.state.writer import prune; print(prune('checkpoints', keep=3))"

A save publishes its file under its step's name (never replacing a file another writer completed), reads
it back and verifies it, and only then prunes. The prune keeps the newest `keep` files that verify and
always the file this writer wrote last; a file that does not verify never takes a keep slot: it is moved
aside into `corrupt/` (kept, reported once), never deleted. A file that does not verify under the name a
save needs is moved aside too, so it cannot block a good save of that step. Only files this runtime wrote
(its header) are ever moved or deleted: another program's file under a checkpoint name is left where it is,
reported once (the worker refuses such a directory at start: refuse_foreign).
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import threading
from collections.abc import Callable

from elastic_mnist import volume
from elastic_mnist.contract.errors import UserError
from elastic_mnist.state.format import (
    CheckpointError,
    TooLargeHere,
    decode,
    encode,
    foreign_files,
    key_mismatch,
    list_checkpoints,
    path_for,
    read_checkpoint,
    shards_of,
    write_durable,
    written_here,
)

CORRUPT_DIR = "corrupt"


class Verifier:
    """Which checkpoint files verify (header, digest, and a state the loader accepts), each file read once:
    (inode, size, mtime) name its content, so a file replaced under the same name is read again."""

    def __init__(self, key: bytes | None = None, warn: Callable[[str], None] = print):
        self.key, self.warn = key, warn
        self._known: dict[tuple, str | None] = {}
        self._foreign: set[str] = set()
        self._too_large: set[str] = set()

    def problem(self, path: str) -> str | None:
        """None when path verifies, else why not."""
        try:
            st = os.stat(path)
            ident = (path, st.st_ino, st.st_size, st.st_mtime_ns)
            if ident not in self._known:
                decode(read_checkpoint(path), path, self.key)  # bounded: a FIFO or huge file is refused unread
                self._known[ident] = None
            self._too_large.discard(path)
            return self._known[ident]
        except TooLargeHere as e:  # not cached: the cap may be higher another time
            self._too_large.add(path)
            return str(e)
        except (CheckpointError, OSError) as e:
            return str(e)

    def set_aside(self, path: str, problem: str) -> bool:
        """Move a file of ours that does not verify into corrupt/ (kept for whoever wants to look at it);
        one this runtime did not write, or wrote with another key (a secret added, dropped or changed: not
        damage), or one only too large to read here now, stays where it is (False)."""
        if path in self._too_large:
            return False  # the read-time warning named it; a size is no sign of damage
        if not written_here(path) or key_mismatch(path, self.key):
            if path not in self._foreign:
                self._foreign.add(path)
                self.warn(f"warning: {path} was not written by elastic-mnist with this run's key ({problem}); "
                          "left where it is, and ignored")
            return False
        aside = os.path.join(os.path.dirname(path), CORRUPT_DIR)
        os.makedirs(aside, exist_ok=True)
        target = os.path.join(aside, os.path.basename(path))
        if os.path.lexists(target):
            target += f".{os.getpid()}-{os.urandom(3).hex()}"
        try:
            os.rename(path, target)
        except FileNotFoundError:  # another writer moved it first
            return True
        if os.path.isdir(shards_of(path)) and not os.path.islink(shards_of(path)):  # a sharded step's rows go too
            with contextlib.suppress(OSError):  # another writer moved them first: the file is what counts
                os.rename(shards_of(path), shards_of(target) if target.endswith(".pt") else target + ".shards")
        self.warn(f"warning: {path} does not verify ({problem}); moved aside to {target} (it takes no place "
                  "among the checkpoints kept)")
        return True


def prune(directory: str, keep: int, protect: str = "", verifier: Verifier | None = None) -> list[str]:
    """Delete all but the newest `keep` verified checkpoints (and `protect`); move aside what does not
    verify. Returns the deleted paths."""
    verifier = verifier or Verifier()
    kept, removed = 0, []
    for _, path in list_checkpoints(directory):
        problem = None if path == protect else verifier.problem(path)
        if problem is not None:
            verifier.set_aside(path, problem)
        elif kept < keep or path == protect:
            kept += 1
        else:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:  # another writer pruned it first
                pass
            _drop_shards(shards_of(path))
    return removed


def _drop_shards(where: str) -> None:
    """A sharded checkpoint's rows go with its file (the file vouches for them; without it they are no step)."""
    if os.path.isdir(where) and not os.path.islink(where):
        shutil.rmtree(where, ignore_errors=True)  # another writer's prune may be removing it too


def refuse_foreign(directory: str, error: type[UserError] = UserError) -> None:
    """A checkpoint name held by another program's file would block the save of that step, and the runtime
    moves, replaces or deletes only files it wrote (a `.generation` or `finished.json` of another program
    would be replaced): such a directory is refused at start (with `error`: a node-local directory's problem
    ends that node only)."""
    from elastic_mnist.state import fence  # fence writes through this module's format: imported when used

    foreign = foreign_files(directory) + fence.foreign_records(directory)
    if foreign:
        raise error(f"--checkpoint-dir {directory} holds {len(foreign)} file(s) under names elastic-mnist writes "
                    f"there that it did not write (e.g. {os.path.basename(foreign[0])}); it never moves, replaces "
                    "or deletes them: move them away, or pass another --checkpoint-dir")


class CheckpointWriter:
    """A writer thread: at most one write in flight; the caller blocks only to snapshot the state.

    The thread is started once and fed through a queue: starting a thread per save made the training
    thread wait for the GIL while the new thread began pickling (milliseconds on a busy machine). With
    `best_effort` (in-memory snapshots) a failed write is kept in `failure` instead of raised: the caller
    decides what a failure means."""

    def __init__(self, directory: str, keep: int, key: bytes | None = None, best_effort: bool = False,
                 warn: Callable[[str], None] = print):
        self.directory, self.keep, self.key, self.best_effort, self.warn = directory, keep, key, best_effort, warn
        self.verifier = Verifier(key, warn)
        self.volume = volume.of(directory)
        self.saved = self.skipped = 0
        self.held_step = -1
        """The newest step this writer saw in the directory: written, or found saved by another writer."""
        self._wrote = False  # a write succeeded since the last wait()
        self.block_ms: list[float] = []
        self.last_path, self.last_size = "", 0
        self.failure: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        # Started now, not at the first save: a thread start on the training thread blocked it ~10 ms.
        self._thread: threading.Thread | None = None
        self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="ckpt-writer")
        self._thread.start()

    def close(self) -> None:
        """Wait for the write in flight and end the thread (safe to repeat; a later save starts another): a
        process kept across rounds makes a writer every round."""
        self._idle.wait()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def save(self, state: dict, step: int, block: bool = False) -> None:
        """state must already be a snapshot (CPU copies): training goes on while the thread writes. While the
        volume is full or read-only (a durable writer's last write failed so), a save is skipped until the
        volume shows room for it again (volume.py)."""
        self.wait()
        if not self.best_effort and not self.volume.ready(self.last_size + self.last_size // 10):
            return
        if self._thread is None:
            self._start()
        self._idle.clear()
        self._queue.put((state, step))
        if block:
            self.wait()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._write(*job)
            except BaseException as e:  # surfaced on the training thread by wait()
                self.failure = e
            finally:
                job = None  # the state it wrote is not this thread's to keep while it waits for the next
                self._idle.set()

    def _write(self, state: dict, step: int) -> None:
        path, blob = path_for(self.directory, step), encode(state, self.key)
        if not write_durable(path, blob):
            problem = self.verifier.problem(path)
            if problem is None:  # another writer (a survivor, an older group) saved this step first
                self.skipped += 1
                self.held_step = max(self.held_step, step)
                return
            if not self.verifier.set_aside(path, problem) or not write_durable(path, blob):
                self.skipped += 1
                return
        problem = self.verifier.problem(path)  # read back: what the storage returns, not what we sent
        if problem is not None:
            raise CheckpointError(f"{path} did not verify after it was written: {problem}")
        self.saved += 1
        self.last_path, self.last_size, self.held_step = path, len(blob), max(self.held_step, step)
        self._wrote = True
        prune(self.directory, self.keep, protect=path, verifier=self.verifier)

    def if_room(self, write: Callable[[], object]) -> object:
        """write() into this directory at once (the fence, a copy at restore, the start's probe); None, with
        the volume's one warning, when the volume is full or read-only. A group that could not write its
        fence token writes unfenced until its next round: names never overwrite, and a newer group only
        ever holds newer steps."""
        try:
            return write()
        except OSError as e:
            full = volume.room_error(e)
            if full is None:
                raise
            self.volume.failed(f"checkpoints into {self.directory}", full, self.warn)
            return None

    def wait(self) -> None:
        """Until the write in flight is done. Its failure is raised here (kept in `failure` when best_effort),
        except that of a full, over-quota or read-only volume: the volume's one warning, and training goes on."""
        self._idle.wait()
        if self.best_effort:
            return
        error, self.failure = self.failure, None
        if error is None:
            if self._wrote:
                self._wrote = False
                self.volume.written(self.warn)
            return
        full = volume.room_error(error)
        if full is None:
            raise RuntimeError(f"checkpoint write to {self.directory} failed: {error}") from error
        self.volume.failed(f"checkpoints into {self.directory}", full, self.warn)
