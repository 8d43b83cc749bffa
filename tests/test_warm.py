"""Warm starts with real processes: a warm server started as an agent starts it, stand-ins that hand their
command over, and what they must keep of a plain process (output, arguments, exit status, signals, death).

    python -m pytest -q tests/test_warm.py
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from elastic_mnist import procs
from elastic_mnist.warm import _wire
from elastic_mnist.warm.server import REQUEST_TIMEOUT_S, start_for_workers

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    from elastic_mnist.warm import handoff
    handoff()
    def on_term(signum, frame):
        print("term", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, on_term)
    print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "cwd": os.getcwd(), "mark": os.environ.get("MARK"),
                      "warm": "ELASTIC_MNIST_STARTED_AT" in os.environ}), flush=True)
    what = sys.argv[1]
    if what == "wait":
        sys.stdin.readline()
    elif what == "killself":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(sys.argv[2]))
""")


@pytest.fixture(scope="module")
def warm():
    """A warm server owned by this module's tests (its agent is the test process), and the environment
    that finds it; it serves every test here, as one serves every worker start of its agent."""
    environ: dict[str, str] = {}
    proc = start_for_workers(environ)
    assert proc is not None
    yield procs.child_env(**environ, MARK="from-env")
    proc.kill()
    proc.wait()


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


def _start(script, env, *args, cwd=None):
    return subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=cwd, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _first_line(proc) -> dict:
    return json.loads(proc.stdout.readline())


def test_a_warm_child_runs_the_command_with_its_output_arguments_and_exit_code(warm, script, tmp_path):
    proc = _start(script, warm, "exit", "7", "--flag=x", cwd=tmp_path)
    seen = _first_line(proc)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 7, err
    assert seen["warm"] and seen["pid"] != proc.pid  # a fork of the server, not the stand-in itself
    assert seen["argv"] == ["exit", "7", "--flag=x"] and seen["cwd"] == str(tmp_path) and seen["mark"] == "from-env"


def test_without_a_server_the_process_starts_cold(script, tmp_path):
    env = procs.child_env(**{_wire.ADDRESS_ENV: _wire.new_address()})  # nobody listens there
    proc = _start(script, env, "exit", "5")
    seen = _first_line(proc)
    proc.communicate(timeout=120)
    assert proc.returncode == 5 and seen["pid"] == proc.pid and not seen["warm"]


def test_a_signal_to_the_stand_in_reaches_the_child(warm, script):
    proc = _start(script, warm, "wait", "0")
    _first_line(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 3  # stdin stays open: only the forwarded signal ends the wait
    assert "term" in proc.stdout.read()
    proc.stdin.close()


def test_a_child_killed_by_a_signal_ends_its_stand_in_by_that_signal(warm, script):
    proc = _start(script, warm, "killself", "0")
    _first_line(proc)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_a_child_outlives_the_request_timeout(warm, script):
    """The child watches its stand-in's connection for the end of the stream: a timeout there is no death."""
    proc = _start(script, warm, "wait", "4")
    child = _first_line(proc)["pid"]
    assert not procs.wait_exit(child, REQUEST_TIMEOUT_S + 3), "the warm child died while its stand-in lived"
    out, _ = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 4


def test_the_child_dies_with_its_stand_in(warm, script):
    proc = _start(script, warm, "wait", "0")
    child = _first_line(proc)["pid"]
    proc.kill()
    proc.wait()
    assert procs.wait_exit(child, 30), "the warm child outlived its killed stand-in"


def test_the_server_refuses_another_interpreter(warm):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(_wire.sockaddr(warm[_wire.ADDRESS_ENV]))
    _wire.send_request(sock, {"exe": "/usr/bin/python9", "version": "9", "preload": []})
    reply = _wire.Lines(sock).next()
    sock.close()
    assert "python9" in reply["refused"]


def test_the_server_ends_with_its_agent():
    agent = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    ready_r, ready_w = os.pipe()
    server = subprocess.Popen([sys.executable, "-m", "elastic_mnist.warm.server", "--agent", str(agent.pid),
                               "--address", _wire.new_address(), "--ready-fd", str(ready_w)], pass_fds=[ready_w])
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1"  # it listens, and watches the agent
        assert os.read(ready_r, 1) == b"2"  # torch imported
        agent.kill()
        agent.wait()
        assert server.wait(timeout=120) == 0
    finally:
        os.close(ready_r)
        server.kill()
        server.wait()


def test_a_node_waits_for_its_import_only_when_it_joins_a_running_job():
    """Joining a running round: import first (the job trains on). A job starting from no node (no state,
    an open round, or a round whose members all stopped beating): import beside the rendezvous."""
    import pickle
    from datetime import datetime, timedelta, timezone

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    from elastic_mnist.rendezvous.etcd_v3 import _joins_a_running_job

    def state(complete: bool, beat_age_s: float) -> tuple[bytes, object]:
        s, node = _RendezvousState(), _NodeDesc("n0", 1, 0)
        s.complete, s.participants = complete, {node: 0}
        s.last_heartbeats = {node: datetime.now(timezone.utc) - timedelta(seconds=beat_age_s)}
        return pickle.dumps(s), 0

    assert _joins_a_running_job(state(True, 1.0))
    assert not _joins_a_running_job(None)
    assert not _joins_a_running_job(state(False, 1.0))
    assert not _joins_a_running_job(state(True, 600.0))
