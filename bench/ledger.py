"""Where the CPU goes while a change stalls the job: each process of a run is sampled from /proc and
charged to a role (agent, warm process, worker, stand-in, etcd, launcher), so a stall can be read as
waiting or as crowding (every core busy).

    python -m bench --scale-only --data-dir ../shared/data     # each row's CPU while it stalled

A sampler thread in the bench process reads every process's stat file each INTERVAL_S; a process is
charged from its first sample (one born in a window counts from zero). Its own CPU goes into the JSON beside
the roles' (`ledger_cpu_s`): it runs on the cores it measures.
"""

from __future__ import annotations

import os
import threading
import time

from elastic_mnist.procs import stat_fields

INTERVAL_S = 0.05
ROLES = (("agent", "torch.distributed.run"), ("stand-in", "elastic_mnist.train"), ("launcher", "elastic_mnist local"),
         ("etcd", "etcd"), ("warm", "elastic_mnist.warm.server"))
"""(role, a word of its command line), first match wins; a warm process's forks are its workers."""
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
SETTLE_LOOKS = 4
"""Samples in which a process's command line is read again: its role is settled once it has surely exec'd."""


class Ledger:
    """`with Ledger() as ledger: run(...)`, then `ledger.window(t0, t1)`: CPU seconds by role."""

    def __init__(self, roles=ROLES, interval_s: float = INTERVAL_S) -> None:
        self._roles, self._interval = roles, interval_s
        self._seen: dict[int, str | None] = {}  # pid -> role (None: not one of ours)
        self._looks: dict[int, int] = {}  # pid -> how often its command line was read (SETTLE_LOOKS at most)
        self._samples: dict[int, list[tuple[float, int]]] = {}  # pid -> [(time, cpu ticks)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-ledger", daemon=True)
        self.own_cpu_s = 0.0

    def __enter__(self) -> Ledger:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            start = time.thread_time()
            self._sample()
            self.own_cpu_s += time.thread_time() - start
            self._stop.wait(self._interval)

    def _sample(self) -> None:
        now = time.time()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            looks = self._looks.get(pid, 0)
            if looks >= SETTLE_LOOKS and self._seen[pid] is None:
                continue  # not one of ours (reading every stat file each time would cost the cores it measures)
            stat = _stat(pid)
            if stat is None:
                continue
            ppid, ticks = stat
            if looks < SETTLE_LOOKS:  # between its fork and its exec a process shows its parent's command line
                self._seen[pid], self._looks[pid] = self._role(pid, ppid), looks + 1
            if self._seen[pid] is not None:
                self._samples.setdefault(pid, []).append((now, ticks))

    def _role(self, pid: int, ppid: int) -> str | None:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return None
        role = next((name for name, word in self._roles if word in command), None)
        # a warm process forks its workers: same command line, the warm process as parent
        return "worker" if role == "warm" and self._seen.get(ppid) == "warm" else role

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each role used between t0 and t1 (as sampled: within INTERVAL_S of each end)."""
        out: dict[str, float] = {}
        for pid, samples in list(self._samples.items()):  # a copy: the sampler adds processes meanwhile
            samples = list(samples)
            before = [ticks for t, ticks in samples if t <= t0]
            upto = [ticks for t, ticks in samples if t <= t1]
            if not upto:
                continue
            used = (upto[-1] - (before[-1] if before else 0)) * TICK_S
            if used > 0:
                out[self._seen[pid]] = out.get(self._seen[pid], 0.0) + used
        return {role: round(used, 3) for role, used in out.items()}


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, user + system CPU ticks) of a process, None when it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else (int(fields[1]), int(fields[11]) + int(fields[12]))
