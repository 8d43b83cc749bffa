"""What a node must give a trainer, checked by `elastic-mnist preflight`: a usable /dev/shm, and for NCCL a
CUDA device whose driver runs the image's CUDA. A failure here is this node's (exit 69), not the job's.

    python -c "from elastic_mnist.ops.nodecheck import driver_problem; print(driver_problem('', '13.0'))"
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from elastic_mnist.errors import NodeLocalError

NVIDIA_VERSION = "/proc/driver/nvidia/version"  # the loaded kernel module's version, in any GPU container
# The oldest driver each CUDA major version runs on (NVIDIA's CUDA release notes, "CUDA Toolkit and
# Minimum Required Driver Version"); the image is CUDA 13.0.
MIN_DRIVER = {12: 525, 13: 580}


# A check failed because of this node (its devices, its mounts); a pod on another node may pass. The
# worker's own type for it: a worker that meets one ends its node (exit 69), not the job.
NodeLocal = NodeLocalError


def driver_problem(version_text: str, cuda: str | None) -> str | None:
    """Why this node's NVIDIA driver cannot run the image's CUDA (from /proc/driver/nvidia/version), or None
    when it can or either version is unknown."""
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+)\.", version_text)
    need = MIN_DRIVER.get(int(cuda.split(".")[0])) if cuda else None
    if not found or need is None or int(found.group(1)) >= need:
        return None
    return (f"the node's NVIDIA driver {found.group(1)} is older than CUDA {cuda} (this image) needs ({need} or "
            "newer): upgrade the node pool's driver, or use an image built on an older CUDA")


def check_device(config) -> str:
    if config.backend != "nccl":
        return f"--backend {config.backend}: no GPU needed"
    import torch

    try:
        version_text = Path(NVIDIA_VERSION).read_text()
    except OSError:
        version_text = ""
    problem = driver_problem(version_text, torch.version.cuda)
    if problem:
        raise NodeLocal(problem)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise NodeLocal("--backend nccl but no CUDA device is visible on this node; the container must "
                        "request nvidia.com/gpu (or use --backend gloo, as the kind variant does)")
    driver = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", version_text)
    return (f"{torch.cuda.device_count()} CUDA device(s), {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
            f"{', driver ' + driver.group(1) if driver else ''}")


SHM = "/dev/shm"


def check_shm(config) -> str:
    """torch's shared-memory tensors, NCCL and the in-memory snapshots live in /dev/shm (Linux)."""
    shm = SHM
    if not sys.platform.startswith("linux"):
        return f"{sys.platform}: no {shm} to check"
    probe = Path(shm) / f".preflight-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise NodeLocal(f"{shm} is not writable on this node ({e.strerror or e}); mount a memory-backed "
                        "emptyDir there") from None
    free = shutil.disk_usage(shm).free
    return f"{shm} writable, {free // 2**20} MiB free"
