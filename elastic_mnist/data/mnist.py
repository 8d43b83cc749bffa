"""MNIST as normalized tensors, and the world-size-invariant batch plan.

    python -c "from elastic_mnist.data.mnist import BatchPlan; print(BatchPlan(60000, 128, 0).rank_indices(5, 3, 1))"

The plan is a function of (seed, epoch, step, global batch) only: epoch e is one permutation seeded by
(seed, e); global step s of that epoch takes positions [s*B, (s+1)*B); the world size only decides how
that global batch is split between ranks. So a resize mid-epoch continues at exactly the next unseen
sample. The last partial batch of each epoch (60000 % 128 = 96 samples) is dropped, for every world
size alike; each epoch's permutation differs, so no sample is dropped every epoch.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from elastic_mnist import files
from elastic_mnist.contract.errors import UserError
from elastic_mnist.data import cache as mnist_cache

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
RAW_FILES = {
    (True, "images"): "train-images-idx3-ubyte",
    (True, "labels"): "train-labels-idx1-ubyte",
    (False, "images"): "t10k-images-idx3-ubyte",
    (False, "labels"): "t10k-labels-idx1-ubyte",
}
BAD_FILE_FIX = "re-download MNIST or point --data-dir at a good copy"


@dataclass
class Split:
    """One MNIST split, decoded once: images [N, 784] float32 normalized, labels [N] int64."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def to(self, device: torch.device) -> Split:
        return Split(self.images.to(device), self.labels.to(device))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(image, label): a Split is also a map-style data set."""
        return self.images[i], self.labels[i]


def dataset_fingerprint(dataset) -> str:
    """Size and a hash of the labels: identifies a data set in checkpoints, the same for the in-memory
    split and torchvision's MNIST of the same files (so --input may change between restarts)."""
    labels = dataset.labels if isinstance(dataset, Split) else getattr(dataset, "targets", None)
    if labels is None:
        return f"{len(dataset)}"
    digest = hashlib.sha256(torch.as_tensor(labels).to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:12]
    return f"{len(dataset)}:{digest}"


def raw_paths(root: str, train: bool) -> tuple[Path, list[Path]]:
    """(root/MNIST/raw, [images file, labels file]) of one split."""
    raw = Path(root) / "MNIST" / "raw"
    return raw, [raw / RAW_FILES[(train, kind)] for kind in ("images", "labels")]


def load_split(root: str, train: bool, download: bool = False, cache_dir: str | Path | None = None) -> Split:
    """Decode MNIST once into tensors (no PIL/ToTensor per sample as in the seed).

    The raw IDX files are read directly when present: importing torchvision costs ~1-2 s, paid again by
    every worker on every membership change. The normalized tensors are cached in a memory-mapped file
    checked against the raw files (data/cache.py), so a restart maps them instead of decoding again.
    torchvision's MNIST remains the path that downloads (and reports a missing data set).
    """
    raw, paths = raw_paths(root, train)
    try:
        # exists, not is_file: a directory in a file's place is a bad file (read_idx names it), not a
        # missing data set to fetch with torchvision.
        if all(p.exists() for p in paths):
            return _load_cached(raw, paths, train, cache_dir)
        if not download:  # the files are missing: say which, whether or not torchvision could fetch them
            missing = ", ".join(p.name for p in paths if not p.exists())
            raise UserError(f"MNIST not found under {raw} (missing {missing}). Point --data-dir (or "
                            "$ELASTIC_MNIST_DATA_DIR) at a directory holding MNIST/raw/*-ubyte, or add --download")
        images, labels = _load_with_torchvision(root, train, download)
    except RuntimeError as e:
        raise UserError(
            f"MNIST not found under {raw} ({e}). Point --data-dir (or $ELASTIC_MNIST_DATA_DIR) at a "
            "directory holding MNIST/raw/*-ubyte, or add --download") from None
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read MNIST under {raw}: {e}; check --data-dir and its files") from None
    return Split(normalize(images.reshape(len(images), -1)), labels.long())


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels [N, 784] -> float32 with MNIST's mean and std, as the seed's transforms do."""
    return images.float().div_(255).sub_(MNIST_MEAN).div_(MNIST_STD).contiguous()


def _load_cached(raw: Path, paths: list[Path], train: bool, cache_dir: str | Path | None) -> Split:
    """The mapped cache when a valid one exists; else decode and try to publish one for the next start."""
    for path in paths:  # before a cache is trusted: its check hashes the raw files
        check_idx(path)
    name = mnist_cache.cache_name(raw, train)
    places = mnist_cache.candidate_dirs(raw, cache_dir)
    for place in places:
        hit = mnist_cache.open_cached(place / name, paths, MNIST_MEAN, MNIST_STD)
        if hit is not None:
            return Split(*hit)
    images, labels = read_split(paths)  # before any write: a bad file never becomes a cache
    split = Split(normalize(images.reshape(len(images), -1)), labels.long())
    for place in places:  # the first writable place wins; none writable: no cache, same tensors
        if mnist_cache.write_cache(place, name, split.images, split.labels, paths) is not None:
            break
    return split


def torchvision(what: str):
    """The torchvision module, or one error line naming the fix (it is an extra: the default path does
    not need it)."""
    try:
        import torchvision
    except ImportError:
        raise UserError(f"{what} needs torchvision, which is not installed: pip install 'elastic-mnist[vision]' "
                        "(or the torchvision release that matches your torch)") from None
    return torchvision


def _load_with_torchvision(root: str, train: bool, download: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ds = torchvision("--download").datasets.MNIST(root=root, train=train, download=download)
    return ds.data, ds.targets


def bad_file(path: Path, what: str) -> UserError:
    """The one line for a malformed MNIST file, the same for the worker and preflight."""
    return UserError(f"MNIST file {path} {what}; {BAD_FILE_FIX}")


# The largest IDX file read (MNIST's largest is 47 MB): a header may promise any size, and a sparse file
# can have it without taking any disk.
IDX_CAP = 1 << 30
_IDX_HEAD = 4 + 4 * 255  # magic, then up to 255 dimensions


def _open_idx(path: Path) -> tuple[int, int, tuple[int, ...]]:
    """(fd, payload offset, dims) of an unsigned-byte IDX file whose size is what its header says, checked
    before its payload is read; the fd is positioned at the payload. A FIFO, device or directory in the
    file's place is refused unread (it could block or never end); a symlink is followed (a data set may be
    one), to a regular file only."""
    try:
        fd, st = files.open_regular(path, "MNIST file", BAD_FILE_FIX, follow_symlinks=True)
    except files.RefusedFile as e:
        raise bad_file(path, e.why) from None
    except OSError as e:  # no read permission, an I/O error
        raise bad_file(path, f"cannot be read ({e.strerror or e})") from None
    try:
        head = os.read(fd, _IDX_HEAD)
        offset, dims = _idx_header(path, head, st.st_size)
        os.lseek(fd, offset, os.SEEK_SET)
        return fd, offset, dims
    except BaseException:
        os.close(fd)
        raise


def _idx_header(path: Path, head: bytes, size: int) -> tuple[int, tuple[int, ...]]:
    if size < 4 or len(head) < 4:
        raise bad_file(path, f"cannot be decoded: it is {size} bytes, shorter than an IDX header (truncated?)")
    magic, = struct.unpack_from(">I", head)
    if magic >> 8 != 0x08:
        raise bad_file(path, f"cannot be decoded: not an unsigned-byte IDX file (magic {magic:#x})")
    offset = 4 + 4 * (magic & 0xFF)
    if size < offset or len(head) < offset:  # the dimension count promises more header than there is
        raise bad_file(path, f"cannot be decoded: it is {size} bytes, its header needs {offset} (truncated?)")
    dims = struct.unpack_from(f">{magic & 0xFF}I", head, 4)
    expected = offset + math.prod(dims)
    if size != expected:
        raise bad_file(path, f"cannot be decoded: it is {size} bytes, its header says {expected} (truncated?)")
    if expected > IDX_CAP:
        raise bad_file(path, f"is {expected:,} bytes, over the cap of {IDX_CAP:,} for an MNIST file")
    return offset, dims


def check_idx(path: Path) -> None:
    """read_idx's checks without reading the payload: what must hold before the file is hashed or mapped."""
    os.close(_open_idx(path)[0])


def read_idx(path: Path) -> torch.Tensor:
    """An unsigned-byte IDX file (MNIST's format) as a uint8 tensor; anything else is a UserError naming it."""
    fd, offset, dims = _open_idx(path)
    with os.fdopen(fd, "rb") as f:
        try:
            payload = f.read(math.prod(dims))
        except OSError as e:
            raise bad_file(path, f"cannot be read ({e.strerror or e})") from None
    if len(payload) != math.prod(dims):  # it shrank while read
        raise bad_file(path, f"cannot be decoded: its payload ended after {len(payload)} bytes (truncated?)")
    if not payload:  # no samples: frombuffer refuses an empty buffer; read_split names the problem
        return torch.empty(dims, dtype=torch.uint8)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).reshape(dims)


def read_split(paths: list[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    """One split's (images [N, 28, 28], labels [N]) uint8, each file checked alone and against the other,
    so a bad file fails here with its name rather than as a shape error deep in training."""
    images, labels = read_idx(paths[0]), read_idx(paths[1])
    if images.dim() != 3 or tuple(images.shape[1:]) != (28, 28) or len(images) == 0:
        raise bad_file(paths[0], f"holds images of shape {list(images.shape)}, not [N > 0, 28, 28]")
    if labels.dim() != 1 or len(labels) != len(images):
        raise bad_file(paths[1], f"holds labels of shape {list(labels.shape)}, not [{len(images)}] "
                                 f"(one per image in {paths[0].name})")
    if int(labels.max()) > 9:  # past the model's 10 classes: the loss would fail mid-step
        raise bad_file(paths[1], f"holds label {int(labels.max())}; MNIST's labels are 0-9")
    return images, labels


def write_synthetic_mnist(root: str | Path, n_train: int = 6000, n_test: int = 1000, seed: int = 0) -> Path:
    """A small learnable stand-in in MNIST's IDX layout, for machines without the real data set.

    Each class is a fixed random stroke pattern plus noise, so a model can reach high accuracy on it.
    """
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    prototypes = (torch.rand(10, 28, 28, generator=gen) > 0.8).float() * 220
    for train, n in ((True, n_train), (False, n_test)):
        labels = torch.randint(0, 10, (n,), generator=gen)
        noise = torch.rand(n, 28, 28, generator=gen) * 120
        images = (prototypes[labels] * (torch.rand(n, 1, 1, generator=gen) * 0.5 + 0.5) + noise).clamp(0, 255)
        _write_idx(raw / RAW_FILES[(train, "images")], images.to(torch.uint8))
        _write_idx(raw / RAW_FILES[(train, "labels")], labels.to(torch.uint8))
    return Path(root)


def _write_idx(path: Path, array: torch.Tensor) -> None:
    magic = 0x0800 | array.dim()  # 0x08: unsigned byte
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.numpy().tobytes())


def shard_bounds(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous share of n items; the first n % world ranks get one more."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass
class BatchPlan:
    """(seed, epoch, step, global batch) → dataset indices; never depends on the world size."""

    num_samples: int
    global_batch_size: int
    seed: int
    _perms: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.global_batch_size > self.num_samples:
            raise UserError(f"--global-batch-size {self.global_batch_size} is larger than the training set "
                            f"({self.num_samples} samples): an epoch would have no step; pass at most "
                            f"{self.num_samples}")

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.num_samples, generator=gen)}  # keep one epoch cached
        return self._perms[epoch]

    def position(self, global_step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of a global step."""
        return divmod(global_step, self.steps_per_epoch)

    def global_indices(self, global_step: int) -> torch.Tensor:
        epoch, step = self.position(global_step)
        b = self.global_batch_size
        return self.permutation(epoch)[step * b:(step + 1) * b]

    def rank_indices(self, global_step: int, world_size: int, rank: int) -> torch.Tensor:
        start, end = shard_bounds(self.global_batch_size, world_size, rank)
        return self.global_indices(global_step)[start:end]
