"""What a quick and a full run measure: steps, repeats, scenarios. One place, so the results JSON can
record exactly the settings its numbers came from."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from elastic_mnist.metrics import Throughput

STEPS_PER_EPOCH_REAL = 60000 // 128  # 468: real MNIST at the global batch of 128


@dataclass
class Settings:
    mode: str
    data_dir: str
    repeats: int
    steps: int
    """Measured steps per throughput run (after `warmup`), the same for every implementation."""
    warmup: int = Throughput.WARMUP_STEPS
    """Steps left out of the numbers: what the trainer's step timer leaves out, so the loops do too."""
    overhead_steps: int = 1400
    overhead_repeats: int = 3
    recovery_steps: int = 200
    fault_step: int = 60
    scenarios: list = field(default_factory=list)
    recovery_repeats: int = 1
    """Runs of each repeated scenario (REPEATED_SCENARIOS) on etcd-v3; the others run once."""
    host_repeats: int = 3
    """Runs of each scenario between hosts (HOST_SCENARIOS, etcd-v3 only); --network-only takes --repeats."""
    backends: list = field(default_factory=lambda: ["etcd-v3", "etcd"])
    tta_epochs: int = 0
    """0: time to accuracy is skipped."""
    tta_threshold: float = 0.98
    global_batch_size: int = 128
    timeout_s: float = 600

    def to_dict(self) -> dict:
        return asdict(self)


ALL_SCENARIOS = ["kill", "term", "stop", "join"]
# Recovery is judged by its median: one run on a shared machine can be off by a second either way.
REPEATED_SCENARIOS = ("kill", "term", "join")
# Each node on a host of its own (`elastic-mnist local --hosts`: network namespaces, root), etcd-v3 only,
# Settings.host_repeats runs each: `python -m bench --network-only [--repeats N]` (bench/network.py).
HOST_SCENARIOS = ("vanish", "partition")


def quick(data_dir: str) -> Settings:
    """About two minutes on two cores: one repeat of everything, one recovery scenario."""
    return Settings(mode="quick", data_dir=data_dir, repeats=1, steps=40, overhead_steps=120, overhead_repeats=1,
                    recovery_steps=70, fault_step=20, scenarios=["kill"], backends=["etcd-v3"], timeout_s=240)


def full(data_dir: str, repeats: int = 3) -> Settings:
    # 400 measured steps (+5 warm-up) stay inside one epoch of real MNIST, so no evaluation lands in the
    # throughput window. Overhead runs span three epochs (see bench.overhead for why). This MLP without a
    # learning-rate schedule hovers around 98% from epoch 5 on (97.9% after 6 in one run), so 10 epochs.
    # The overhead target (3%) is finer than run-to-run noise on a shared machine: at least 5 pairs.
    return Settings(mode="full", data_dir=data_dir, repeats=repeats, steps=400, overhead_steps=1400,
                    overhead_repeats=max(repeats, 5), recovery_repeats=5,
                    scenarios=list(ALL_SCENARIOS) + (list(HOST_SCENARIOS) if os.geteuid() == 0 else []),
                    tta_epochs=10)
