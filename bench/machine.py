"""What the numbers were measured on: CPU model, cores, memory, GPU, versions, date."""

from __future__ import annotations

import json
import os
import platform
import time


def describe() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1), "gpu": gpu,
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def one_line(m: dict) -> str:
    gpu = m["gpu"] or "no GPU"
    return f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {gpu}; torch {m['torch']}; {m['date']}"


def emit(result: dict, out: str | None) -> None:
    """A probe's result, with the machine it was measured on: printed as JSON, and written to `out` if given."""
    text = json.dumps({"machine": describe(), **result}, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
