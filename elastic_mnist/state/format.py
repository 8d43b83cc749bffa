"""Checkpoints: durable, verified, never overwritten, written in the background.

    python -c "from elastic_mnist.state.format import describe_latest; print(describe_latest('checkpoints'))"

File `ckpt-{step:09d}.pt` = 8-byte magic, u32 format version, sha256 of the payload, then the payload
(torch.save of a dict of tensors and plain values, loaded with weights_only=True). Written to a temp
file, fsynced, then published under its name without replacing an existing one (a hard link, or
elastic_mnist.state.publish's fallback on filesystems without them): a name, once it exists, always holds a
complete, verified file, and a late writer (a node that woke from a freeze) can never replace it.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import queue
import re
import struct
import threading
import time
from collections.abc import Callable

import torch

from elastic_mnist import files
from elastic_mnist.errors import UserError
from elastic_mnist.state import publish

MAGIC = b"EMNISTCK"
FORMAT_VERSION = 1
_HEADER = struct.Struct(">8sI32s")
_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")


class CheckpointError(Exception):
    """A checkpoint file that is truncated, corrupt or not ours."""


def encode(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    return _HEADER.pack(MAGIC, FORMAT_VERSION, hashlib.sha256(payload).digest()) + payload


def digest_of(blob: bytes) -> str:
    """The payload checksum stored in the header: identifies a state without decoding it."""
    return blob[_HEADER.size - 32:_HEADER.size].hex()


def decode(blob: bytes, name: str = "checkpoint") -> dict:
    if len(blob) < _HEADER.size:
        raise CheckpointError(f"{name}: truncated ({len(blob)} bytes)")
    magic, version, digest = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CheckpointError(f"{name}: not an elastic-mnist checkpoint")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{name}: format version {version}, this code reads {FORMAT_VERSION}")
    payload = memoryview(blob)[_HEADER.size:]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{name}: checksum mismatch (truncated or corrupt)")
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)


def path_for(directory: str, step: int) -> str:
    return os.path.join(directory, f"ckpt-{step:09d}.pt")


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint-named file, newest first; temp files are not listed."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(directory, n)) for n in names if (m := _NAME.match(n))]
    return sorted(found, reverse=True)


def write_durable(path: str, data: bytes, replace: bool = False) -> bool:
    """Write data at path atomically; unless replace, False (and nothing written) if path exists.

    The data is complete and fsynced under a temporary name before the final name appears, so a
    reader never sees a half-written file under it. Without replace, the publish step is the
    directory's no-clobber method (elastic_mnist.state.publish): a late writer never replaces a file
    another writer completed."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    return files.write_then(path, data, 0o644, lambda tmp, final: publish.publish(tmp, final, replace))


def iter_valid(directory: str, warn: Callable[[str], None] = print):
    """(step, path, blob, state) of each checkpoint that verifies, newest first; a damaged one is
    skipped with a warning naming it (and kept on disk)."""
    for step, path in list_checkpoints(directory):
        try:
            with open(path, "rb") as f:
                blob = f.read()
            yield step, path, blob, decode(blob, path)
        except (CheckpointError, OSError, RuntimeError) as e:
            warn(f"warning: skipping checkpoint {path}: {e}")


def load_latest(directory: str, warn: Callable[[str], None] = print) -> tuple[dict, str] | None:
    """The newest checkpoint that verifies."""
    for _, path, _, state in iter_valid(directory, warn):
        return state, path
    return None


def check_compatible(state: dict, fingerprint: dict, path: str) -> None:
    """Refuse a checkpoint from another model shape, batch size, seed or data set."""
    theirs = state.get("fingerprint", {})
    diffs = [f"{k} {theirs.get(k)!r} (checkpoint) vs {v!r} (now)" for k, v in fingerprint.items() if theirs.get(k) != v]
    if diffs:
        raise UserError(
            f"checkpoint {path} belongs to another configuration: {'; '.join(diffs)}. Use the original "
            "flags, or a different --checkpoint-dir for a new run (nothing was deleted)")


def ensure_writable(directory: str) -> str:
    """Create the directory and exercise the real publish step there; the method it uses.

    A probe file is published exactly as a checkpoint is (no-clobber), a second publish under the
    same name must be refused, and both are removed: a filesystem that cannot do this fails here,
    naming the cause, rather than at the first save."""
    probe = os.path.join(directory, f".write-probe-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.makedirs(directory, exist_ok=True)
        try:
            if not write_durable(probe, b"first") or write_durable(probe, b"second"):
                raise OSError(errno.EIO, "a second publish under one name was not refused")
            with open(probe, "rb") as f:
                if f.read() != b"first":
                    raise OSError(errno.EIO, "a published file was overwritten")
        finally:
            if os.path.lexists(probe):
                os.unlink(probe)
    except OSError as e:
        raise UserError(f"checkpoint dir {directory} is not writable ({e.strerror or e}); fix its "
                        "permissions or storage class, or pass another --checkpoint-dir") from None
    return publish.method_of(directory)


def prune(directory: str, keep: int) -> list[str]:
    removed = []
    for _, path in list_checkpoints(directory)[keep:]:
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:  # another writer pruned it first
            pass
    return removed


def describe_latest(directory: str) -> dict | None:
    """Step, epoch, path and age of the newest valid checkpoint (for `status` and reports)."""
    found = load_latest(directory, warn=lambda _msg: None)
    if found is None:
        return None
    state, path = found
    return {"path": path, "step": state["step"], "epoch": state["epoch"], "world_size": state["world_size"],
            "saved_at": state["saved_at"], "age_s": round(time.time() - state["saved_at"], 1)}


class CheckpointWriter:
    """A writer thread: at most one write in flight; the caller blocks only to snapshot the state.

    The thread is started once and fed through a queue: starting a thread per save made the training
    thread wait for the GIL while the new thread began pickling (milliseconds on a busy machine).
    """

    def __init__(self, directory: str, keep: int):
        self.directory, self.keep = directory, keep
        self.saved = self.skipped = 0
        self.block_ms: list[float] = []
        self.last_path = ""
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        # Started now, not at the first save: a thread start on the training thread blocked it ~10 ms.
        self._thread = threading.Thread(target=self._run, daemon=True, name="ckpt-writer")
        self._thread.start()

    def save(self, state: dict, step: int, block: bool = False) -> None:
        """state must already be a snapshot (CPU copies): training goes on while the thread writes."""
        self.wait()
        self._idle.clear()
        self._queue.put((state, step))
        if block:
            self.wait()

    def _run(self) -> None:
        while True:
            state, step = self._queue.get()
            try:
                self._write(state, step)
            except BaseException as e:  # surfaced on the training thread by wait()
                self._error = e
            finally:
                self._idle.set()

    def _write(self, state: dict, step: int) -> None:
        path = path_for(self.directory, step)
        if write_durable(path, encode(state)):
            self.saved += 1
            self.last_path = path
            prune(self.directory, self.keep)
        else:
            self.skipped += 1

    def wait(self) -> None:
        self._idle.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint write to {self.directory} failed: {error}") from error
