"""Fault points for tests: a worker signals itself at an exact step and place, so a test can put a peer's
death or freeze inside the data collective or inside the control agreement, which outside timing cannot.

    ELASTIC_MNIST_FAULT=stop:rank=1:step=20:at=data torchrun ... -m elastic_mnist.train ...

kind: stop (SIGSTOP, a frozen machine) or kill (SIGKILL); at: data (before the step's forward pass, so its peers
wait in the gradient all-reduce) or control (after the optimizer step, so its peers wait in the per-step
agreement). Fires once, and only in a process that trained a step before that point (a worker restarted at that
step does not fire again). kill at muster, with round=N instead of step: the worker dies inside the muster of
the round torchrun counts as restart N, once its store is up, so its peers wait there for it (round, not step: a
process that never trained a step must fire, and only in that round). kind fail, at teardown (rank any by
default): the end of the first in-place round that ends at or after that step reports its teardown as failed
(worker/life.py falls back to a fresh start). Unset in production: nothing happens."""

from __future__ import annotations

import os
import signal
import time

from elastic_mnist.contract.env import FAULT_ENV

_SIGNALS = {"stop": signal.SIGSTOP, "kill": signal.SIGKILL}
_PLACES = {"stop": ("data", "control"), "kill": ("data", "control", "muster"), "fail": ("teardown",)}


def parse(text: str) -> dict | None:
    """'stop:rank=1:step=20:at=data' -> {'kind': 'stop', 'rank': 1, 'step': 20, 'at': 'data'}."""
    if not text:
        return None
    kind, *pairs = text.split(":")
    fields = dict(p.split("=", 1) for p in pairs)
    if fields.get("at") not in _PLACES.get(kind, ()):
        raise ValueError(f"{FAULT_ENV}={text!r}: expected stop|kill:rank=R:step=S:at=data|control, "
                         "kill:rank=R:round=N:at=muster or fail:rank=R:step=S:at=teardown")
    rank = fields.get("rank", "any")  # a fail may name no rank: whichever the process holds (tests pick a node)
    return {"kind": kind, "rank": -1 if rank == "any" else int(rank), "step": int(fields.get("step", -1)),
            "round": int(fields.get("round", -1)), "at": fields["at"]}


class FaultPoints:
    def __init__(self, rank: int, start_step: int, text: str | None = None):
        self.fault = parse(os.environ.get(FAULT_ENV, "") if text is None else text)
        self.rank, self.start_step = rank, start_step

    def failure(self, at: str, step: int) -> str:
        """The failure injected at `at` for this rank once `step` is reached ("" when none): fires once."""
        f = self.fault
        if f is None or f["kind"] != "fail" or f["at"] != at or f["rank"] not in (-1, self.rank) or \
                not self.start_step < f["step"] <= step:
            return ""
        self.fault = None
        return f"{at} failed ({FAULT_ENV})"

    def reach(self, at: str, step: int) -> None:
        f = self.fault
        if f is not None and f["kind"] in _SIGNALS and (f["rank"], f["step"], f["at"]) == (self.rank, step, at) \
                and step > self.start_step:
            self._fire(f"step {step} ({at})")

    def reach_muster(self, rank: int, restart: int) -> None:
        f = self.fault
        if f is not None and f["at"] == "muster" and (f["rank"], f["round"]) == (rank, restart):
            self._fire(f"round {restart} (muster)")

    def _fire(self, where: str) -> None:
        kind, self.fault = self.fault["kind"], None
        print(f"[fault] {kind} at {where} time {time.time():.3f}", flush=True)
        os.kill(os.getpid(), _SIGNALS[kind])
