"""The checkpoint file: header, checksum or keyed digest, encode and decode; durable no-clobber writes.

    python -c "from elastic_mnist.state.format import describe_latest; print(describe_latest('checkpoints'))"

File `ckpt-{step:09d}.pt` = 8-byte magic, u32 format version, a 32-byte digest of the payload, then the
payload (torch.save of a dict of tensors and plain values, loaded with weights_only=True). Version 1's
digest is the payload's sha256; version 2's is an HMAC-SHA256 keyed with the job's secret, so a file
planted by someone without the secret is refused before it is unpickled; version 3 (what a job with a
secret writes) holds 8 bytes naming the key (derived from it, so they tell nothing of it), then the HMAC's
first 24 bytes. A file of another key than the run's (keyed in a run without a secret, plain in one with,
keyed with another secret) is a configuration error (KeyMismatch), never a corrupt file. Written to a temp
file, fsynced, then published under its name without replacing an existing one (a hard link, or
elastic_mnist.state.publish's fallback on filesystems without them): a name, once it exists, always holds a
complete, verified file, and a late writer (a node that woke from a freeze) can never replace it.

Reading one is bounded (`read_checkpoint`): a regular file only (a FIFO or device named ckpt-*.pt is
refused at once, before any digest could be checked), of at most `read_limit` bytes.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import io
import os
import re
import stat
import struct
import time
from collections.abc import Callable

import torch

from elastic_mnist import files, volume
from elastic_mnist.config import with_former_fields
from elastic_mnist.contract.errors import NodeLocalError, UserError
from elastic_mnist.state import publish

MAGIC = b"EMNISTCK"
FORMAT_VERSION = 1
KEYED_VERSION = 2  # read, no longer written: its header does not say which key
KEY_ID_VERSION = 3
_KEY_ID = 8  # bytes of the digest field that name the key, in version 3
_HEADER = struct.Struct(">8sI32s")
_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
# A state is written from the same registered objects every time, so two files of one job differ by a few
# counters and, before the first step, by the optimizer's moments (Adam: two per parameter, 3x the model's
# bytes). STATE_GROWTH x the newest state this process wrote or verified in a directory leaves room for both.
STATE_GROWTH = 8
_REFUSED_FIX = "it is not a checkpoint this job wrote: move it out of the directory (nothing was read from it)"
_TOO_LARGE_FIX = "too large to read here now, which does not make it corrupt: it is left where it is, unread"
_known_sizes: dict[str, int] = {}  # directory -> bytes of the newest state written or verified there


class CheckpointError(Exception):
    """A checkpoint file that is truncated, corrupt or not ours."""


class KeyMismatch(CheckpointError):
    """A checkpoint of this job's format keyed otherwise than this run: the secret was added, dropped or
    changed between runs. Not a damaged file: it is never skipped, moved aside or pruned."""


def checkpoint_key(secret: bytes | None) -> bytes | None:
    """The digest key of a job with a secret (derived, so it is never the key that seals the rendezvous)."""
    return hmac.new(secret, b"elastic-mnist checkpoint digest", hashlib.sha256).digest() if secret else None


def _key_id(key: bytes) -> bytes:
    return hmac.new(key, b"elastic-mnist checkpoint key id", hashlib.sha256).digest()[:_KEY_ID]


def _digest(payload, key: bytes | None, version: int = KEY_ID_VERSION) -> bytes:
    if not key:
        return hashlib.sha256(payload).digest()
    mac = hmac.new(key, payload, hashlib.sha256).digest()
    return mac if version == KEYED_VERSION else _key_id(key) + mac[:32 - _KEY_ID]


def encode(state: dict, key: bytes | None = None) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    return _HEADER.pack(MAGIC, KEY_ID_VERSION if key else FORMAT_VERSION, _digest(payload, key)) + payload


def digest_of(blob: bytes) -> str:
    """The payload digest stored in the header: identifies a state without decoding it."""
    return blob[_HEADER.size - 32:_HEADER.size].hex()


def key_problem(version: int, digest: bytes, key: bytes | None) -> str | None:
    """Why a header of `version` does not belong to a run keyed with `key` (None: it may)."""
    if version == FORMAT_VERSION and key is not None:
        return "written without a job secret, and this run has one"
    if version in (KEYED_VERSION, KEY_ID_VERSION) and key is None:
        return "keyed with a job secret, and this run has none"
    if version == KEY_ID_VERSION and digest[:_KEY_ID] != _key_id(key):
        return "keyed with another job secret than this run's"
    return None


def verified_payload(blob: bytes, name: str = "checkpoint", key: bytes | None = None) -> memoryview:
    """The payload of a blob whose header and digest check out (nothing is unpickled here)."""
    if len(blob) < _HEADER.size:
        raise CheckpointError(f"{name}: truncated ({len(blob)} bytes)")
    magic, version, digest = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CheckpointError(f"{name}: not an elastic-mnist checkpoint")
    if version not in (FORMAT_VERSION, KEYED_VERSION, KEY_ID_VERSION):
        raise CheckpointError(f"{name}: format version {version}, this code reads {FORMAT_VERSION} to {KEY_ID_VERSION}")
    problem = key_problem(version, digest, key)
    if problem:
        raise KeyMismatch(f"{name}: {problem}")
    payload = memoryview(blob)[_HEADER.size:]
    if not hmac.compare_digest(_digest(payload, key, version), digest):
        raise CheckpointError(f"{name}: " + ("digest mismatch (corrupt, or keyed with another secret)" if key else
                                              "checksum mismatch (truncated or corrupt)"))
    return payload


def decode(blob: bytes, name: str = "checkpoint", key: bytes | None = None) -> dict:
    payload = verified_payload(blob, name, key)
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever the loader refuses (a class off its allow-list, a bad
        # archive, ...) makes this file unusable, like a truncated one: skipped, never fatal
        raise CheckpointError(f"{name}: refused by torch.load(weights_only=True): {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{name}: not a training state (no integer step)")
    return state


CGROUP = "/sys/fs/cgroup"  # the process's cgroup v2 files (a pod's memory limit); tests point it at a fake tree


def available_memory() -> int:
    """Bytes this process can still allocate: MemAvailable, less under a cgroup v2 memory limit (a pod)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = _cgroup_headroom(CGROUP)
    return max(avail if headroom is None else min(avail, headroom), 0)


def _cgroup_headroom(root: str) -> int | None:
    """memory.max less what the cgroup holds and cannot give back; None without a limit. memory.current also
    counts the page cache (every file read or written: the checkpoints themselves), which the kernel reclaims
    before it refuses an allocation, so the cache (memory.stat's active_file + inactive_file) is not counted.
    Snapshots in /dev/shm are shmem, not in those two: they count."""
    try:
        with open(os.path.join(root, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(root, "memory.current")) as f:
            current = int(f.read())
        with open(os.path.join(root, "memory.stat")) as f:
            fields = dict(line.split()[:2] for line in f if len(line.split()) >= 2)
        cache = int(fields.get("active_file", 0)) + int(fields.get("inactive_file", 0))
        return int(limit) - max(current - cache, 0)
    except (OSError, ValueError):
        return None  # no cgroup v2 limit visible: the machine's figure stands


def read_limit(directory: str | None = None) -> int:
    """The most bytes a state may hold to be read: STATE_GROWTH x the newest state this process wrote or
    verified in `directory`, or, before it knows one, half the memory available now (decoding holds the
    bytes and the tensors built from them at once). A size it already held is never refused for memory:
    a cap that moves with other programs' memory must not turn the job's own state away."""
    known = _known_sizes.get(os.path.abspath(directory), 0) if directory else 0
    return STATE_GROWTH * known if known else available_memory() // 2


class TooLargeHere(CheckpointError):
    """A file over the read cap: perhaps a good state this process cannot hold now; never called corrupt."""


def read_checkpoint(path: str, limit: int | None = None) -> bytes:
    """The bytes of a checkpoint file, bounded (read_limit); CheckpointError naming why it is refused."""
    limit = read_limit(os.path.dirname(path) or ".") if limit is None else limit
    try:
        return files.read_regular(path, limit, "checkpoint", _REFUSED_FIX)
    except files.RefusedFile as e:
        if e.too_large:
            raise TooLargeHere(f"{path}: {e.why}; {_TOO_LARGE_FIX}") from None
        raise CheckpointError(f"{path}: {e.why}; {_REFUSED_FIX}") from None


def _note_size(path: str, size: int) -> None:
    _known_sizes[os.path.abspath(os.path.dirname(path) or ".")] = size


def path_for(directory: str, step: int) -> str:
    return os.path.join(directory, f"ckpt-{step:09d}.pt")


SHARDS_KEY = "shards"
"""The key of a sharded run's checkpoint that names its rows' directory and their files' sha256."""


def shards_of(path: str) -> str:
    """The directory beside a sharded run's checkpoint file that holds its rows (state/sharded_files.py)."""
    return path.removesuffix(".pt") + ".shards"


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint-named file, newest first; temp files are not listed."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(directory, n)) for n in names if (m := _NAME.match(n))]
    return sorted(found, reverse=True)


def _head(path: str) -> bytes:
    """The first bytes of a regular file (up to a header), b"" for anything else; nothing blocks or follows."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return b""
    try:
        return os.read(fd, _HEADER.size) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return b""
    finally:
        os.close(fd)


def written_here(path: str) -> bool:
    """Whether a file under a checkpoint name was written by this runtime (it starts with MAGIC), whatever
    became of the rest of it: only such files are ever moved aside or deleted."""
    return _head(path).startswith(MAGIC)


def foreign_files(directory: str) -> list[str]:
    """Files under checkpoint names that this runtime did not write (another program's, or a planted one). A
    file gone between the listing and its read is none: another writer's keep-k removed a checkpoint of ours
    (called foreign, it would refuse a joining node, and with shared storage end the job)."""
    return [path for _, path in list_checkpoints(directory) if not written_here(path) and os.path.lexists(path)]


def key_mismatch(path: str, key: bytes | None) -> str | None:
    """Why a checkpoint of ours belongs to another key than `key`, from its header alone; None if it may not."""
    head = _head(path)
    if len(head) < _HEADER.size or not head.startswith(MAGIC):
        return None
    _, version, digest = _HEADER.unpack_from(head)
    return key_problem(version, digest, key)


_KEY_FIXES = {
    "has one": "run without it (drop secret_file from --rdzv-conf, unset $ELASTIC_MNIST_RDZV_SECRET_FILE)",
    "has none": "run with the job's secret (--rdzv-conf secret_file=FILE or $ELASTIC_MNIST_RDZV_SECRET_FILE)",
    "run's": "run with the secret that wrote them",
}


def key_error(what: str, problem: str) -> UserError:
    """The one line for checkpoints of another key: `what` names them ("checkpoint PATH is", "DIR holds 3 ...")."""
    fix = next(fix for end, fix in _KEY_FIXES.items() if problem.endswith(end))
    return UserError(f"{what} {problem}: the job's secret changed between runs. To resume, {fix}; for a new run, "
                     "pass another directory. Nothing was moved or changed")


def _unnamed_keys(directory: str, key: bytes | None) -> list[tuple[str, str]]:
    """Keyed files of the format before key names (version 2), when not one of them verifies with `key`:
    written with another secret (damage spares some). One that verifies proves the key; the rest is damage."""
    if key is None:
        return []
    unnamed = [path for _, path in list_checkpoints(directory)
               if _head(path)[len(MAGIC):len(MAGIC) + 4] == KEYED_VERSION.to_bytes(4, "big")]
    for path in unnamed:
        try:
            verified_payload(read_checkpoint(path), path, key)
            return []
        except (CheckpointError, OSError):
            continue
    return [(path, "keyed with another job secret than this run's") for path in unnamed]


def refuse_other_key(directory: str, key: bytes | None, flag: str = "--checkpoint-dir") -> None:
    """Every checkpoint of ours in `directory` must be of this run's key: a UserError (key_error) otherwise."""
    found = [(path, why) for _, path in list_checkpoints(directory) if (why := key_mismatch(path, key))]
    found += _unnamed_keys(directory, key)
    if found:
        path, why = found[0]
        raise key_error(f"{flag} {directory} holds {len(found)} checkpoint(s) (e.g. {os.path.basename(path)})", why)


def write_durable(path: str, data: bytes, replace: bool = False) -> bool:
    """Write data at path atomically; unless replace, False (and nothing written) if path exists.

    The data is complete and fsynced under a temporary name before the final name appears, so a
    reader never sees a half-written file under it. Without replace, the publish step is the
    directory's no-clobber method (elastic_mnist.state.publish): a late writer never replaces a file
    another writer completed."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    if _NAME.match(os.path.basename(path)):
        _note_size(path, len(data))  # before the read-back that verifies it
    return files.write_then(path, data, 0o644, lambda tmp, final: publish.publish(tmp, final, replace))


def iter_valid(directory: str, warn: Callable[[str], None] = print, key: bytes | None = None, above: int = -1):
    """(step, path, blob, state) of each checkpoint named after a step past `above` that verifies, newest
    first; a damaged one, or one refused unread (not a regular file, over read_limit), is skipped with a
    warning naming it (and kept). Files named `above` or older are not read at all."""
    for step, path in list_checkpoints(directory):
        if step <= above:
            return
        try:
            blob = read_checkpoint(path)
            state = decode(blob, path, key)
        except KeyMismatch as e:  # a configuration error, not a damaged file: nothing is skipped
            raise key_error(f"checkpoint {path} is", str(e).removeprefix(f"{path}: ")) from None
        except CheckpointError as e:  # its message starts with the path
            warn(f"warning: skipping checkpoint {e}")
            continue
        except OSError as e:
            warn(f"warning: skipping checkpoint {path}: {e.strerror or e}")
            continue
        _note_size(path, len(blob))
        yield step, path, blob, state


def load_latest(directory: str, warn: Callable[[str], None] = print,
                key: bytes | None = None) -> tuple[dict, str] | None:
    """The newest checkpoint that verifies."""
    for _, path, _, state in iter_valid(directory, warn, key):
        return state, path
    return None


def check_compatible(state: dict, fingerprint: dict, path: str) -> None:
    """Refuse a checkpoint from another model shape, batch size, seed or data set."""
    theirs = with_former_fields(state.get("fingerprint", {}))
    diffs = [f"{k} {theirs.get(k)!r} (checkpoint) vs {v!r} (now)" for k, v in fingerprint.items() if theirs.get(k) != v]
    if diffs:
        raise UserError(
            f"checkpoint {path} belongs to another configuration: {'; '.join(diffs)}. Use the original "
            "flags, or a different --checkpoint-dir for a new run (nothing was deleted)")


def ensure_writable(directory: str) -> str:
    """Create the directory and exercise the real publish step there; the method it uses. A full,
    over-quota or read-only volume raises its OSError; anything else that fails is a UserError.

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
    except OSError as e:  # this node's disk or mount (preflight says the same): it ends this node, not the job
        if volume.room_error(e) is not None:
            raise  # full or read-only: the caller trains on (elastic_mnist/volume.py)
        blocker = files.file_in_the_way(directory)
        why = f"{blocker} is a file, not a directory" if blocker else e.strerror or e
        raise NodeLocalError(f"checkpoint dir {directory} is not writable on this node ({why}); fix its "
                             "permissions or storage class, or pass another --checkpoint-dir") from None
    return publish.method_of(directory)


def describe_latest(directory: str, key: bytes | None = None) -> dict | None:
    """Step, epoch, path and age of the newest valid checkpoint (for `status` and reports)."""
    found = load_latest(directory, warn=lambda _msg: None, key=key)
    if found is None:
        return None
    state, path = found
    return {"path": path, "step": state["step"], "epoch": state["epoch"], "world_size": state["world_size"],
            "saved_at": state["saved_at"], "age_s": round(time.time() - state["saved_at"], 1)}
