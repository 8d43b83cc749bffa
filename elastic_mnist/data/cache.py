"""A decoded, normalized MNIST split as one memory-mapped file, so a restarted worker skips the decode.

    python -c "from elastic_mnist.data.mnist import load_split; print(load_split('/data', True).images.shape)"

Every worker start used to decode the IDX files and normalize 47 M pixels (0.3-1 s on a busy CPU),
paid again on every membership change. The first start writes `mnist-{split}-{key}.bin`: a 4 KiB JSON
header, then the float32 images and int64 labels. Later starts map it copy-on-write (numpy memmap), so
the pages come from the OS page cache and the tensors cost nothing until read.

Trust: the header records the raw files' size, mtime and sha256. A cache is used only when its size is
exactly what the header promises, the raw files still hash to the recorded sha256 (re-hashed only when
their size or mtime changed), the labels equal the raw labels and a sample of image rows equals the
raw rows normalized. Anything else (truncated, garbage, stale, other data set) is ignored and rebuilt.
Writes go to a temporary file, fsynced, then renamed: a reader never sees half a cache.

Where: beside the data (`<data-dir>/MNIST/cache/`) when writable, else `$XDG_CACHE_HOME/elastic-mnist`
(`~/.cache/elastic-mnist`), or the directory given by `cache_dir` / $ELASTIC_MNIST_CACHE_DIR.
No writable place: the split is decoded as before, nothing is cached. "Writable" is what the mode says,
for root too: root passes every permission check, so a data dir made read-only (0555) would otherwise
get a cache written into it (`writable`).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import numpy as np
import torch

from elastic_mnist.contract.env import CACHE_DIR_ENV
from elastic_mnist.files import atomic_write, sha256_of

HEADER_BYTES = 4096
FORMAT = "elastic-mnist-split-v1"
SAMPLED_ROWS = 256  # rows compared against the raw file on every load: ~1 ms, catches a wrong payload


def raw_identity(paths: list[Path], known: dict | None = None) -> dict:
    """{name: {size, mtime_ns, sha256}}; the sha256 is reused from `known` when size and mtime match."""
    out = {}
    for p in paths:
        st = p.stat()
        entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        old = (known or {}).get(p.name) or {}
        same = {k: old.get(k) for k in entry} == entry and old.get("sha256")
        out[p.name] = {**entry, "sha256": old["sha256"] if same else sha256_of(p)}
    return out


def candidate_dirs(raw_dir: Path, cache_dir: str | Path | None) -> list[Path]:
    """Where a cache may live, most preferred first."""
    explicit = cache_dir or os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return [Path(explicit)]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [raw_dir.parent / "cache", Path(xdg) / "elastic-mnist"]


def cache_name(raw_dir: Path, train: bool) -> str:
    """Per data directory, so one shared cache dir can serve several data sets."""
    key = hashlib.sha256(str(raw_dir.resolve()).encode()).hexdigest()[:12]
    return f"mnist-{'train' if train else 'test'}-{key}.bin"


def writable(directory: Path) -> bool:
    """May we write in `directory` (or, where it does not exist yet, create it in its nearest existing
    ancestor)? access(2) answers for everyone but root, who passes it on any mode: for root the mode
    itself must allow a write (some write bit set), as a read-only data dir (0555) means "nobody writes"."""
    existing = next((d for d in (directory, *directory.parents) if os.path.lexists(d)), None)
    if existing is None or not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        return False  # not a directory (a file in the way), no permission, or a read-only mount (EROFS)
    return os.geteuid() != 0 or bool(os.stat(existing).st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _payload_bytes(n: int, row: int) -> tuple[int, int]:
    return n * row * 4, n * 8


def open_cached(path: Path, raw_paths: list[Path], mean: float, std: float):
    """(images, labels) mapped from a valid cache of these raw files, else None."""
    try:  # O_NONBLOCK|O_NOFOLLOW and fstat: a FIFO or symlink under the cache's name is refused, not waited on
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            header = json.loads(f.read(HEADER_BYTES).rstrip(b"\0 \n"))
        if header.get("format") != FORMAT:
            return None
        n, row = int(header["n"]), int(header["row"])
        image_bytes, label_bytes = _payload_bytes(n, row)
        if path.stat().st_size != HEADER_BYTES + image_bytes + label_bytes:
            return None
        if raw_identity(raw_paths, header["raw"]) != header["raw"]:
            return None  # stale: the raw files changed
        images = np.memmap(path, np.float32, "c", HEADER_BYTES, (n, row))
        labels = np.memmap(path, np.int64, "c", HEADER_BYTES + image_bytes, (n,))
        if not _matches_raw(images, labels, raw_paths, mean, std):
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # unreadable or garbage (a header that is JSON but no object included): rebuilt by the caller
    return torch.from_numpy(images), torch.from_numpy(labels)


def _raw_arrays(raw_paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """The raw IDX files mapped read-only (images [N, rows*cols] uint8, labels [N] uint8)."""
    images = np.memmap(raw_paths[0], np.uint8, "r", 16)
    labels = np.memmap(raw_paths[1], np.uint8, "r", 8)
    return images.reshape(len(labels), -1), labels


def _matches_raw(images: np.ndarray, labels: np.ndarray, raw_paths: list[Path], mean: float, std: float) -> bool:
    raw_images, raw_labels = _raw_arrays(raw_paths)
    if raw_images.shape != images.shape or not np.array_equal(raw_labels, labels):
        return False
    rows = np.random.default_rng().integers(0, len(labels), size=min(SAMPLED_ROWS, len(labels)))
    expected = (raw_images[rows].astype(np.float32) / 255 - mean) / std
    # A tolerance, not equality: numpy and torch may round the last bit differently.
    return bool(np.allclose(expected, images[rows], rtol=0, atol=1e-5))


def write_cache(directory: Path, name: str, images: torch.Tensor, labels: torch.Tensor,
                raw_paths: list[Path]) -> Path | None:
    """Publish a cache atomically (temp file, fsync, rename); None when the directory is not writable."""
    header = json.dumps({"format": FORMAT, "n": len(labels), "row": images.shape[1],
                         "raw": raw_identity(raw_paths)}).encode()
    if len(header) >= HEADER_BYTES or not writable(directory):
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # 0644: the other users of a shared data dir read it too.
        atomic_write(directory / name, [header.ljust(HEADER_BYTES, b" "),
                                        memoryview(images.contiguous().numpy()).cast("B"),
                                        memoryview(labels.to(torch.int64).contiguous().numpy()).cast("B")], 0o644)
        return directory / name
    except OSError:
        return None
