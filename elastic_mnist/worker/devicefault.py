"""A GPU that fails while training (an Xid, an uncorrectable ECC error, a device that fell off the bus) is the
node's fault, not the job's: the worker ends its node with the node-local exit (69), so that its index fails, the
start watchdog marks the node, a spare index takes over elsewhere and the others train on at the smaller size.

    from elastic_mnist.worker.devicefault import device_fault
    device_fault(RuntimeError("CUDA error: uncorrectable ECC error encountered"))   # -> "this node's GPU failed ..."

Recognised by the CUDA runtime's own words (cudaGetErrorString, which torch puts after "CUDA error: ") or by the code
torch attaches to its AcceleratorError. Only errors of the device count: a device-side assert, an out-of-memory or a
cuBLAS status is the program's, and crashes the worker as before (torchrun restarts it; the node's crash budget
ends a node that keeps failing). Without this, a broken GPU is retried in place until that budget is spent.
"""

from __future__ import annotations

import re

# cudaError_t -> its cudaGetErrorString text: the errors a failing device raises (sticky: the CUDA context of
# the process is unusable after them), plus a device that is gone or not usable at all.
DEVICE_ERRORS = {
    700: "an illegal memory access was encountered",  # cudaErrorIllegalAddress (Xid 13/31/43 and memory faults)
    719: "unspecified launch failure",  # cudaErrorLaunchFailure
    214: "uncorrectable ECC error encountered",  # cudaErrorECCUncorrectable (Xid 48/63/64)
    220: "uncorrectable NVLink error detected during the execution",  # cudaErrorNvlinkUncorrectable (Xid 74)
    714: "hardware stack error",  # cudaErrorHardwareStackError
    715: "an illegal instruction was encountered",  # cudaErrorIllegalInstruction
    46: "CUDA-capable device(s) is/are busy or unavailable",  # cudaErrorDevicesUnavailable
    100: "no CUDA-capable device is detected",  # cudaErrorNoDevice (a GPU that fell off the bus, Xid 79)
    999: "unknown error",  # cudaErrorUnknown (what a lost device often reports)
}
_PREFIX = re.compile(r"CUDA (?:driver )?error: (.*)")


def device_fault(error: BaseException) -> str | None:
    """Why this error is a fault of this node's GPU (one line naming it and what to do), or None when it is not;
    the error's causes and contexts are searched too (torch re-raises device errors from inside DDP and data)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found = _cuda_words(error)
        if found:
            return (f"this node's GPU failed ({found}): an Xid, ECC or NVLink error or a lost device; this node "
                    "leaves the job, which goes on without it. Check the node (`nvidia-smi -q -d ECC`, Xid lines in "
                    "the kernel log) before it trains again")
        error = error.__cause__ or error.__context__
    return None


def _cuda_words(error: BaseException) -> str | None:
    code = getattr(error, "error_code", None)
    if code in DEVICE_ERRORS:
        return f"CUDA error {code}: {DEVICE_ERRORS[code]}"
    for line in str(error).splitlines():
        found = _PREFIX.search(line)
        if found and any(found.group(1).startswith(words) for words in DEVICE_ERRORS.values()):
            return found.group(0).strip()
    return None
