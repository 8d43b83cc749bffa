"""The scale bench's probes with real processes. The CPU ledger: a process that spins is charged to its role
for the time it spun, a window before it started charges nothing, and a fork of a "warm" process is its
worker. The teardown probe: a killed process's connection ends, later the more memory it held. The stand-in
probe: a process is charged the CPU it used, and one that fails is an error, not a number.

    python -m pytest -q tests/test_bench_probes.py
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from bench.ledger import Ledger
from bench.stand_in import cpu_ms
from bench.teardown import socket_close_ms

SPIN = textwrap.dedent("""
    import os, sys, time
    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
    if sys.argv[1] == "fork":  # the parent is the "warm" process, its fork the one charged as a worker
        pid = os.fork()
        if pid == 0:
            spin(0.4)
            sys.stdin.read()  # alive until the test closes stdin: its last CPU is sampled before it goes
            os._exit(0)
        sys.stdin.read()
        os.waitpid(pid, 0)
    else:
        spin(0.4)
        sys.stdin.read()
""")


def _run(marker: str, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SPIN, mode, marker], stdin=subprocess.PIPE)


def test_a_spinning_process_is_charged_to_its_role_and_only_inside_the_window():
    roles = (("spinner", "ledger-spinner-marker"), ("warm", "ledger-warm-marker"))
    with Ledger(roles, interval_s=0.02) as ledger:
        before = time.time()
        spinner = _run("ledger-spinner-marker", "plain")
        warm = _run("ledger-warm-marker", "fork")
        try:
            # both spun their 0.4 s of CPU once their CPU stops growing: read it from the ledger itself
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                used = ledger.window(before, time.time())
                if used.get("spinner", 0) >= 0.35 and used.get("worker", 0) >= 0.35:
                    break
                time.sleep(0.05)
        finally:
            for proc in (spinner, warm):
                proc.stdin.close()
                proc.wait(timeout=30)
        after = time.time()
    used = ledger.window(before, after)
    assert 0.35 <= used["spinner"] <= 1.0 and 0.35 <= used["worker"] <= 1.0, used
    assert used.get("warm", 0) < 0.3, f"the fork's CPU is its own, not its parent's: {used}"
    assert ledger.window(before - 10, before - 5) == {}, "nothing ran then"
    assert 0 < ledger.own_cpu_s < after - before


def test_a_killed_process_closes_its_connection_after_its_memory_is_gone():
    small, large = socket_close_ms(0), socket_close_ms(256)
    assert 0 < small < large < 5000, (small, large)


def test_the_stand_in_probe_charges_a_process_its_cpu_and_refuses_a_failed_one():
    spun = cpu_ms("import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass", None)
    assert 300 <= spun < 3000
    with pytest.raises(RuntimeError, match="exited 3"):
        cpu_ms("raise SystemExit(3)", None)
