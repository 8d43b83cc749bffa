"""`elastic-mnist pod` after torchrun exits: it reaps the container's remaining processes (orphans handed to it)
until none is left, for at most its bound, then kills the rest. Real processes, in a child that is the reaper.

    python -m pytest -q tests/test_pod_entry.py

(tests/e2e/test_k8s_stops.py runs the whole pod entry over torchrun; tests/test_k8s_policy.py checks the
bounds against the rendered manifests.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import worker_env

pytestmark = pytest.mark.slow  # processes of their own

# A container in small: this process is the reaper (a subreaper, as PID 1 would be); its child starts a
# grandchild that outlives it (a worker still saving when torchrun is gone) and exits at once.
_REAPER = """
import json, os, subprocess, sys, time
from elastic_mnist import procs
from elastic_mnist.ops import pod
assert procs.become_subreaper()
sleep_s, bound_s = float(sys.argv[1]), float(sys.argv[2])
child = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys; subprocess.Popen(['sleep', sys.argv[1]]); print('started', flush=True)", str(sleep_s)],
    stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "started\\n"
child.wait()
start = time.monotonic()
killed = pod.drain(start + bound_s)
print(json.dumps({"killed": killed, "waited_s": time.monotonic() - start, "left": procs.descendants(os.getpid())[1:]}))
"""


def drain(sleep_s: float, bound_s: float) -> dict:
    run = subprocess.run([sys.executable, "-c", _REAPER, str(sleep_s), str(bound_s)], capture_output=True, text=True,
                         timeout=60, env=worker_env())
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_an_orphan_finishing_within_the_bound_is_waited_for():
    done = drain(sleep_s=1.0, bound_s=15.0)
    assert done["killed"] == 0 and 0.8 <= done["waited_s"] < 10 and done["left"] == [], done


def test_an_orphan_past_the_bound_is_killed_at_the_bound():
    done = drain(sleep_s=120.0, bound_s=0.5)
    assert done["killed"] == 1 and 0.5 <= done["waited_s"] < 5 and done["left"] == [], done
