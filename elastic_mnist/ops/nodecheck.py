"""What a node must give a trainer, checked by `elastic-mnist preflight`: a usable /dev/shm, and for NCCL a
CUDA device whose driver runs the image's CUDA and whose kernels run. A failure here is this node's (exit 69), not
the job's.

    python -c "from elastic_mnist.ops.nodecheck import driver_problem; print(driver_problem('', '13.0'))"
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

from elastic_mnist.contract.errors import NodeLocalError

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
    ran = kernel_probe(torch)
    return (f"{torch.cuda.device_count()} CUDA device(s), {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
            f"{', driver ' + driver.group(1) if driver else ''}; {ran}")


# A first kernel creates the CUDA context and loads cuBLAS: seconds on a healthy GPU. A device that has not answered
# in a minute is hung (an Xid), and this node's pod would hang in its first step as well.
KERNEL_TIMEOUT_S = 60.0
_N = 64
_hung: list[threading.Thread] = []


def kernel_probe(torch_module, timeout_s: float = KERNEL_TIMEOUT_S) -> str:
    """A tiny matmul on every visible GPU, waited for (synchronize) within timeout_s each: a device whose driver
    loads but whose kernels fail, hang or compute wrong (an Xid, an ECC error, a GPU fallen off the bus) fails
    here, before the rendezvous, instead of in the job's first step. "no GPU" where none is visible."""
    cuda = torch_module.cuda
    count = cuda.device_count() if cuda.is_available() else 0
    if count < 1:
        return "no GPU"
    started = time.monotonic()
    for device in range(count):
        _probe_one(torch_module, device, timeout_s)
    return f"a test kernel ran on {count} GPU(s) in {time.monotonic() - started:.1f}s"


def _probe_one(torch_module, device: int, timeout_s: float) -> None:
    outcome: dict = {}

    def run() -> None:
        try:
            a = torch_module.ones(_N, _N, device=f"cuda:{device}")
            outcome["sum"] = float((a @ a).sum().item())
            torch_module.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - whatever the device raises, it failed the probe
            outcome["error"] = e

    # A thread, so that a hung device cannot hang preflight: the wait is bounded, the thread is left behind.
    thread = threading.Thread(target=run, name=f"gpu-kernel-probe-{device}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        _hung.append(thread)
        raise NodeLocal(f"GPU {device}: a 64x64 test matmul did not finish within {timeout_s:.0f}s: the device hangs "
                        "(look for Xid lines in the node's kernel log, `nvidia-smi`)")
    if "error" in outcome:
        words = (str(outcome["error"]).splitlines() or [type(outcome["error"]).__name__])[0]
        raise NodeLocal(f"GPU {device} failed a 64x64 test matmul ({words[:200]}): check the device (`nvidia-smi -q -d "
                        "ECC`, Xid lines in the node's kernel log)")
    if outcome["sum"] != _N ** 3:
        raise NodeLocal(f"GPU {device} computed a 64x64 test matmul wrong (sum {outcome['sum']:.0f}, expected "
                        f"{_N ** 3}): the device corrupts results; check it (`nvidia-smi -q -d ECC`)")


def kernel_hung() -> bool:
    """Whether a probe's thread is still stuck in the device: the process must then end without waiting for it."""
    return any(t.is_alive() for t in _hung)


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
