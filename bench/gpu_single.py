"""The GPU check's in-process parts on one device: a resume that restores the RNG (CUDA's on a GPU), the
abort path (the watch thread aborts the data group while the main thread is blocked in a collective,
then saves the last agreed step) and peak GPU memory with and without the failure-state copy.

    python -m bench.gpu_check --data-dir ../shared/data      # runs these among the rest (--dry-run: CPU)
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_mnist.config import TrainConfig
from elastic_mnist.contract import exit_codes
from elastic_mnist.distributed import DistEnv
from elastic_mnist.state import format as checkpoint
from elastic_mnist.worker.build import build_trainer
from elastic_mnist.worker.control import ControlPlane
from elastic_mnist.worker.task import MnistMLP

AGREED, BLOCK_S = 20, 20.0  # steps before the fault; how long the blocked collective may wait at most


def _trainer(work: Path, data_dir: str, device: torch.device, stack: ExitStack, **flags):
    config = TrainConfig(data_dir=data_dir, checkpoint_dir=str(work / "ckpt"), log_dir=str(work / "runs"),
                         log_every=10**6, checkpoint_every=0, snapshot_every=0, **flags)
    return build_trainer(config, DistEnv(), MnistMLP(), ControlPlane(1, config), stack, device)


def _steps(trainer, n: int, confirm: bool = True) -> None:
    """The trainer's step (worker/trainer.py) without its loop's reporting: n steps, each agreed."""
    for _ in range(n):
        loss, _idx = trainer.forward_backward(trainer.progress.step)
        with trainer._state_lock:
            trainer.math.apply()
            trainer.progress.step += 1
        if confirm:
            trainer.checkpoints.confirm_step()


def _rng_now(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _blocked_collective(device: torch.device, aborted: threading.Event) -> str:
    """Block the calling thread in the data group's collective until the abort frees it (or BLOCK_S).
    On one GPU a lone rank's all-reduce cannot wait for a peer, so it waits behind a long kernel, in
    NCCL's blocking wait, which notices the abort; on CPU (--dry-run) the wait is the abort itself."""
    if device.type != "cuda":
        return "returned" if aborted.wait(BLOCK_S) else "timed out"
    torch.cuda._sleep(int(BLOCK_S * 1e9))  # ~BLOCK_S s of GPU cycles (the clock rate varies)
    work = dist.all_reduce(torch.ones(1, device=device), async_op=True)
    try:
        work.wait(timedelta(seconds=BLOCK_S))
        return "returned"
    except Exception as e:  # noqa: BLE001 - what an aborted collective raises is the measurement
        return f"raised {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def check_resume_and_abort(work: Path, data_dir: str, device: torch.device) -> dict:
    """Train AGREED steps and save; a new trainer resumes there (RNG as saved); one more step runs
    unagreed, the main thread blocks in a collective, the watch thread declares the peer lost."""
    with ExitStack() as stack:
        first = _trainer(work, data_dir, device, stack, failure_state="copy")
        _steps(first, AGREED)
        first.checkpoints.finish(superseded=False)
        saved_rng = checkpoint.load_latest(str(work / "ckpt"))[0]["rng"]
    with ExitStack() as stack:
        trainer = _trainer(work, data_dir, device, stack, failure_state="copy")
        saved = saved_rng["cuda"][device.index or 0] if device.type == "cuda" else saved_rng["torch"]
        resume = {"resumed_at": trainer.progress.step, "rng_restored": torch.equal(_rng_now(device), saved),
                  "cuda_rng_saved": "cuda" in saved_rng}
        _steps(trainer, 2)  # agreed: AGREED + 2
        _steps(trainer, 1, confirm=False)  # done here, not agreed: the failure save must not take it
        exits, aborted, abort = [], threading.Event(), trainer.failure._abort
        trainer.failure._exit = exits.append  # observe the exit code instead of ending this process
        trainer.failure._abort = lambda: (abort and abort(), aborted.set())
        t0 = time.monotonic()
        watch = threading.Thread(target=trainer._on_peer_lost, args=("gpu check: simulated peer loss",))
        watch.start()
        blocked = _blocked_collective(device, aborted)
        freed_s = time.monotonic() - t0
        watch.join(BLOCK_S + trainer.failure.bounds.end_s)
        newest = checkpoint.list_checkpoints(str(work / "ckpt"))[0][0]
    ok = resume["resumed_at"] == AGREED and resume["rng_restored"] and newest == AGREED + 2 \
        and exits == [exit_codes.RESTART]
    return {"ok": ok, **resume, "main_thread": blocked, "main_freed_s": round(freed_s, 3),
            "saved_step": newest, "live_step": AGREED + 3, "exit_code": exits[0] if exits else None,
            "save_done_s": round(time.monotonic() - t0, 3)}


def check_memory(work: Path, data_dir: str, device: torch.device) -> dict:
    """Peak device memory of AGREED steps with --failure-state copy and live, and the copy's size."""
    out = {}
    for mode in ("copy", "live"):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        with ExitStack() as stack:
            trainer = _trainer(work / mode, data_dir, device, stack, failure_state=mode)
            _steps(trainer, AGREED)
            kept = trainer.checkpoints._confirmed_tensors or []
            out[mode] = {"copy_bytes": sum(t.numel() * t.element_size() for t in kept),
                         "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    return {"ok": out["copy"]["copy_bytes"] > 0 and out["live"]["copy_bytes"] == 0, **out}


def run(work: Path, data_dir: str, device: torch.device, backend: str) -> dict:
    """Both checks in this process, in a one-rank group of `backend` (nccl on a GPU, gloo for --dry-run)."""
    dist.init_process_group(backend, store=dist.FileStore(str(work / "store"), 1), rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    try:
        memory = check_memory(work / "memory", data_dir, device)
        abort = check_resume_and_abort(work / "abort", data_dir, device)  # last: it aborts the group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"memory": memory, "resume_and_abort": abort}
