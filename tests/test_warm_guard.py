"""The warm process against requests and clients it must not trust: malformed requests, a client that
stalls, one that lacks the agent's token, preloads that make a fork unsafe, and stand-ins whose process has
less privilege than the warm process. Real warm server, real stand-in processes.

    python -m pytest -q tests/test_warm_guard.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from elastic_mnist import agent_link, procs
from elastic_mnist.warm.agent import start_for_workers

COLD = "elastic-mnist warm start: starting cold: "
# A stand-in whose request is changed by `sys.argv[1]` (Python, on `r`) before it is sent: as a stand-in of
# another version, or a broken one, would send it. It prints where it runs.
STAND_IN = textwrap.dedent("""
    import json, os, sys
    from elastic_mnist.warm import _wire, handoff
    real = _wire.request_from_here
    def changed(*args):
        r = real(*args)
        exec(sys.argv[1], {"r": r})
        return r
    _wire.request_from_here = changed
    handoff()
    print(json.dumps({"pid": os.getpid(), "warm": "ELASTIC_MNIST_STARTED_AT" in os.environ}), flush=True)
""")


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A warm server of this module (its agent is the test process); its stderr goes to a file."""
    log = tmp_path_factory.mktemp("warm") / "server.log"
    environ: dict[str, str] = {}
    saved, fd = os.dup(2), os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)  # the server inherits it; this process's own stderr is back at once
    try:
        server = start_for_workers(agent_link.create(environ), environ)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)
    assert server is not None
    script = log.parent / "stand_in.py"
    script.write_text(STAND_IN)
    yield procs.child_env(**environ), log, script
    server.end()


def stand_in(warm, change: str = "", cwd=None) -> tuple[subprocess.CompletedProcess, dict]:
    env, _, script = warm
    done = subprocess.run([sys.executable, str(script), change], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done, json.loads(done.stdout)


@pytest.mark.parametrize("change, why", [
    ("r['settings']['rlimits'] = []", "'settings.rlimits' is not a map of RLIMIT_ names"),
    ("del r['cwd']", "'cwd' missing or not a str"),
    ("r['cwd'] = '/nonexistent/dir'", "'cwd' '/nonexistent/dir' is not an existing directory"),
    ("r['settings']['nice'] = 99", "'settings.nice' is not a niceness from -20 to 19"),
    ("r['settings']['affinity'] = []", "'settings.affinity' is not a list of CPU numbers"),
    ("r['settings']['rlimits']['RLIMIT_NOFILE'] = [1]", "'settings.rlimits.RLIMIT_NOFILE' is not a [soft, hard]"),
    ("r['env']['A=B'] = 'x'", "'env' holds something other than NAME=VALUE strings"),
    ("r['started'] = float('nan')", "'started' nan is not a time"),
    ("r['target'] = {'path': 'relative.py'}", "'target' names no module and no absolute path"),
    ("r['unbuffered'] = 1", "'unbuffered' missing or not a bool"),
])
def test_a_malformed_request_is_refused_in_one_line_and_the_stand_in_starts_cold(warm, change, why):
    done, seen = stand_in(warm, change)
    assert not seen["warm"] and "Traceback" not in done.stderr, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"{COLD}malformed request: {why}"), line


def test_a_well_formed_request_is_served_warm(warm):
    done, seen = stand_in(warm)
    assert seen["warm"] and done.stderr == ""
