"""An agent's private directory (agent_link.py): created locked, swept only once its agent is gone, whatever
pid namespace the agent and the sweeper each run in (a shared $TMPDIR).

    python -m pytest -q tests/test_agent_link.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from elastic_mnist import agent_link, procs

# An agent elsewhere: in another pid namespace its pid and start time say nothing here. Its start time is
# made one that no process here has, so its name would read "dead" to a check by pid.
AGENT = textwrap.dedent("""
    import sys
    from elastic_mnist import agent_link, procs
    procs.start_ticks = lambda pid: 1
    print(agent_link.create({}), flush=True)
    sys.stdin.read()
""")


def _agent(tmp_path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=procs.child_env(TMPDIR=str(tmp_path)))
    return proc, proc.stdout.readline().strip()


def test_a_live_agents_directory_is_never_swept_and_a_dead_ones_is(tmp_path):
    proc, path = _agent(tmp_path)
    try:
        assert os.path.dirname(path) == str(tmp_path) and os.path.basename(path).startswith(agent_link.PREFIX)
        (open(os.path.join(path, "warm.sock"), "w")).close()
        assert agent_link.sweep_dead(str(tmp_path)) == [] and os.path.isdir(path), "its agent holds the lock"
    finally:
        proc.kill()  # no exit handler runs: the directory stays, unlocked
        proc.wait()
    assert os.path.isdir(path)
    assert agent_link.sweep_dead(str(tmp_path)) == [path] and not os.path.exists(path)


def test_directories_of_an_earlier_version_are_judged_by_pid_and_left_alone_otherwise(tmp_path):
    """Without a lock file (an agent of an earlier version): its pid and start time, as that version did.
    Anything not of this runtime's form is never touched."""
    me = tmp_path / f"{agent_link.PREFIX}{os.getpid()}-{procs.start_ticks(os.getpid())}-abc"
    gone = tmp_path / f"{agent_link.PREFIX}{os.getpid()}-1-abc"
    other = tmp_path / f"{agent_link.PREFIX}notapid-abc"
    for d in (me, gone, other):
        d.mkdir()
    assert agent_link.sweep_dead(str(tmp_path)) == [str(gone)]
    assert me.is_dir() and other.is_dir()
