"""Warm starts with real processes: a warm server started as an agent starts it, stand-ins that hand their
command over, and what they must keep of a plain process (output, arguments, exit status, signals, death).

    python -m pytest -q tests/test_warm.py
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from elastic_mnist import agent_link, procs
from elastic_mnist.contract.env import WARM_ADDRESS_ENV
from elastic_mnist.rendezvous._warm_start import start_for_workers
from elastic_mnist.warm import _wire, settings
from elastic_mnist.warm.inbox import REQUEST_TIMEOUT_S

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
    warm = start_for_workers(agent_link.create(environ), environ)
    assert warm is not None
    yield procs.child_env(**environ, MARK="from-env")
    warm.end()


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


# Modules a stand-in never uses: each costs it milliseconds of CPU on every node at every change, when N
# stand-ins start at once (dataclasses alone, with inspect, was a fifth of its start).
NOT_IN_A_STAND_IN = {"torch", "dataclasses", "inspect", "typing", "hashlib", "secrets", "tempfile", "shutil",
                     "random", "platform", "pathlib"}


def test_a_stand_in_imports_only_the_modules_it_uses():
    """What `python -m elastic_mnist.train` imports before it hands over, without site (whose editable-install
    finder brings pathlib): the package's path is put first by hand."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import sys; sys.path.insert(0, {root!r}); from elastic_mnist.warm import handoff; "
            "from elastic_mnist.worker.stop import install_early; print(' '.join(sys.modules))")
    loaded = set(subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                                check=True).stdout.split())
    assert "elastic_mnist.warm.handoff" in loaded and "socket" in loaded
    assert sorted(loaded & NOT_IN_A_STAND_IN) == []


def test_a_warm_child_runs_the_command_with_its_output_arguments_and_exit_code(warm, script, tmp_path):
    proc = _start(script, warm, "exit", "7", "--flag=x", cwd=tmp_path)
    seen = _first_line(proc)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 7, err
    assert seen["warm"] and seen["pid"] != proc.pid  # a fork of the server, not the stand-in itself
    assert seen["argv"] == ["exit", "7", "--flag=x"] and seen["cwd"] == str(tmp_path) and seen["mark"] == "from-env"


def test_without_a_server_the_process_starts_cold(script, tmp_path):
    env = procs.child_env(**{WARM_ADDRESS_ENV: str(tmp_path / "warm.sock")})  # nobody listens there
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


ASK = textwrap.dedent("""
    import json, os, socket, struct, sys
    from elastic_mnist.contract.env import WARM_TOKEN_ENV
    from elastic_mnist.contract.warm import encode
    from elastic_mnist.warm import _wire
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    raw = sys.stdin.buffer.read()
    if sys.argv[2] == "json":  # as a stand-in of the agent sends it: with the token its environment holds
        raw = json.dumps({"token": os.environ.get(WARM_TOKEN_ENV, "")} | json.loads(raw)).encode()
    if sys.argv[2] != "raw":  # a JSON object as it is (well formed or not), framed as the wire frames it
        raw = struct.pack("!I", len(raw)) + raw
    try:  # a stranger is refused (and its connection closed) as it connects: its sending may fail
        socket.send_fds(sock, [raw[:4]], list(_wire.STDIO))  # with the stand-in's descriptors
        if raw[4:]:  # (a head the server refuses at once is answered before more could be sent)
            sock.sendall(raw[4:])
    except OSError:
        pass
    try:
        print(json.dumps(encode(_wire.receive(sock)[0])))
    except EOFError:
        print("{}")
""")


def _ask(env: dict, request, raw: bool = False) -> dict:
    """What the warm process that `env` names answers a stand-in (a child of this test process, the server's
    agent, with its token)."""
    data = request if raw else json.dumps(request).encode()
    done = subprocess.run([sys.executable, "-c", ASK, env[WARM_ADDRESS_ENV], "raw" if raw else "json"], input=data,
                          capture_output=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_server_refuses_another_interpreter(warm):
    request = _wire.request_from_here((), 0.0, {}).to_json() | {"exe": "/usr/bin/python9", "version": "9"}
    assert "python9" in _ask(warm, request)["refused"]


@pytest.mark.slow  # a warm process of its own (torch imported again)
def test_the_server_ends_with_its_agent(tmp_path):
    agent = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    ready_r, ready_w = os.pipe()
    token_r, token_w = os.pipe()
    os.close(token_w)  # no token: it serves nobody, and ends all the same
    server = subprocess.Popen([sys.executable, "-m", "elastic_mnist.warm.server", "--agent", str(agent.pid),
                               "--address", str(tmp_path / "warm.sock"), "--ready-fd", str(ready_w),
                               "--token-fd", str(token_r)], pass_fds=[ready_w, token_r])
    os.close(ready_w)
    os.close(token_r)
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


# -- the warm process hardened -------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, why", [
    (b"\x00\x00\x00\x05[1,2]", "not a JSON object"),
    (b"\x00\x00\x00\x04nope", "bad request"),
    (b"\xff\xff\xff\xff", "a message of"),
])
def test_a_malformed_request_gets_one_line_and_the_server_goes_on(warm, script, raw, why):
    assert why in _ask(warm, raw, raw=True)["refused"]
    good = _wire.request_from_here((), 0.0, {}).to_json()
    missing = {k: v for k, v in good.items() if k != "env"}
    assert _ask(warm, missing)["refused"].startswith("malformed request: 'env'")
    proc = _start(script, warm, "exit", "0")
    assert _first_line(proc)["warm"] and proc.wait(timeout=60) == 0, "still serving"


def test_only_the_agents_own_workers_are_served_on_a_private_socket(warm):
    address = warm[WARM_ADDRESS_ENV]
    assert os.stat(os.path.dirname(address)).st_mode & 0o777 == 0o700 and stat.S_ISSOCK(os.stat(address).st_mode)
    # A grandchild of the agent (the shell stays its parent) is no worker of it: another program of this user.
    done = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$0" "$1" json; true', ASK, address],
                          input=json.dumps(_wire.request_from_here((), 0.0, {}).to_json()).encode(),
                          capture_output=True, timeout=60, env=procs.child_env())
    assert "is not a worker of this agent" in json.loads(done.stdout)["refused"], done.stderr


def test_a_fork_that_cannot_take_the_stand_ins_settings_makes_it_start_cold(warm):
    request = _wire.request_from_here((), 0.0, settings.capture()).to_json()
    request["settings"]["affinity"] = [8191]  # no such CPU here
    assert "cannot take the worker's process settings over" in _ask(warm, request)["refused"]


def test_the_worker_keeps_the_stand_ins_affinity_nice_umask_and_limits(warm, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        import json, os, resource
        from elastic_mnist.warm import handoff
        handoff()
        mask = os.umask(0)
        print(json.dumps({"warm": "ELASTIC_MNIST_STARTED_AT" in os.environ, "umask": mask, "nice": os.nice(0),
                          "cpus": sorted(os.sched_getaffinity(0)),
                          "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)}))
    """))
    cpu = min(os.sched_getaffinity(0))
    command = f'umask 027; ulimit -n 512; exec nice -n 3 taskset -c {cpu} "{sys.executable}" "{probe}"'
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=120, env=warm)
    seen = json.loads(done.stdout)
    assert seen == {"warm": True, "umask": 0o027, "nice": os.nice(0) + 3, "cpus": [cpu], "nofile": [512, 512]}


TORCH = "import torch\ntorch.set_num_threads(2)\n"


@pytest.mark.slow  # a warm process of its own (torch imported again) and a probe that hangs until its bound
@pytest.mark.parametrize("preload, why", [
    (f"{TORCH}x = torch.ones(256, 256); (x @ x).sum()", "hung in its first torch op"),
    (f"{TORCH}torch.cuda.is_available()", "CUDA was initialised in the warm process"),
    # A thread, Python's or native: a lock it holds at the fork stays held in the worker (it deadlocks).
    ("import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), name='poller', daemon=True).start()",
     "started 1 thread(s) (poller), and a fork keeps none of them"),
    ("import _thread, time\n_thread.start_new_thread(time.sleep, (3600,))", "started 1 thread(s), and a fork"),
])
def test_a_preload_that_makes_forks_unsafe_starts_workers_cold_saying_why(tmp_path, monkeypatch, script, preload,
                                                                           why):
    (tmp_path / "unsafe_preload.py").write_text(f"{preload}\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    environ: dict[str, str] = {}
    warm = start_for_workers(agent_link.create(environ), environ, probe_timeout_s=3.0, preload=("unsafe_preload",))
    try:
        proc = _start(script, procs.child_env(**environ), "exit", "0")
        seen = _first_line(proc)
        _, err = proc.communicate(timeout=120)
        assert not seen["warm"] and seen["pid"] == proc.pid and proc.returncode == 0
        assert err.count("starting cold: ") == 1 and why in err, err
    finally:
        warm.end()


# -- a worker kept across rounds (in-place) ------------------------------------------------------------------
KEPT = textwrap.dedent("""
    import json, os, sys
    from elastic_mnist.warm import handoff
    handoff()
    from elastic_mnist.contract import kept
    session, rounds = kept.session(), 0
    while True:
        rounds += 1
        print(json.dumps({"pid": os.getpid(), "round": rounds, "argv": sys.argv[2:]}), flush=True)
        if session is None or rounds == 2:
            sys.exit(7)
        session.detach(5)
        what, why = session.wait(60, lambda: False)
        if what is not kept.Wake.ATTACH:
            open(sys.argv[1], "w").write(f"{what.value}: {why}")
            if what is kept.Wake.REFUSE:
                session.refuse(why)
            sys.exit(0)
""")


def _kept(tmp_path, env, local_rank: str, *args):
    path = tmp_path / "kept.py"
    path.write_text(KEPT)
    proc = subprocess.Popen([sys.executable, str(path), str(tmp_path / "left"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**env, "LOCAL_RANK": local_rank})
    seen = json.loads(proc.stdout.readline())
    out, err = proc.communicate(timeout=120)
    return proc.returncode, seen, err


def test_a_kept_worker_takes_the_next_rounds_stand_in(warm, tmp_path):
    code, first, _ = _kept(tmp_path, warm, "11", "a")
    assert code == 5 and first["round"] == 1, "its stand-in exits with the detach code; the worker stays"
    code, second, _ = _kept(tmp_path, warm, "11", "a")
    assert code == 7 and second == {"pid": first["pid"], "round": 2, "argv": ["a"]}, "the same process, round 2"


def test_a_kept_worker_that_is_not_the_rounds_worker_leaves_and_a_fresh_one_serves(warm, tmp_path):
    code, first, _ = _kept(tmp_path, warm, "12", "a")
    assert code == 5
    code, second, err = _kept(tmp_path, warm, "12", "b")
    assert code == 5 and second["round"] == 1 and second["pid"] != first["pid"] and second["argv"] == ["b"]
    assert (tmp_path / "left").read_text().startswith("refuse: the round's worker differs from the one built here "
                                                      "(arguments)")
    assert procs.wait_exit(first["pid"], 30)


REOPEN = textwrap.dedent("""
    import io, os, sys
    from elastic_mnist.warm import become
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=True), write_through=True)  # one that owns fd 1
    for _ in range(100):  # a hundred rounds' stand-ins
        become._reopen_stdio(unbuffered=True)
    print(len(become._REPLACED), os.fstat(1).st_mode != 0, flush=True)
""")


def test_a_kept_workers_stdio_of_past_rounds_is_let_go_of_but_no_descriptor_closed():
    done = subprocess.run([sys.executable, "-c", REOPEN], capture_output=True, text=True, timeout=60,
                          env=procs.child_env())
    assert done.stdout.split() == ["1", "True"], done.stdout + done.stderr  # only the stream that owns fd 1 kept


@pytest.mark.slow  # a warm process of its own (torch imported again)
def test_kept_workers_end_with_their_agent(tmp_path):
    environ: dict[str, str] = {}
    warm = start_for_workers(agent_link.create(environ), environ)
    code, first, _ = _kept(tmp_path, procs.child_env(**environ), "0", "a")
    assert code == 5 and procs.alive(first["pid"])
    warm.end()
    assert (tmp_path / "left").read_text() == "end: its agent ends" and not procs.alive(first["pid"])
    assert not os.path.exists(environ[WARM_ADDRESS_ENV]), "the socket is removed with its warm process"
