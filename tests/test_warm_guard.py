"""The warm process against requests and clients it must not trust: malformed requests, a client that
stalls, one that lacks the agent's token, preloads that make a fork unsafe, and stand-ins whose process has
less privilege than the warm process. Real warm server, real stand-in processes.

    python -m pytest -q tests/test_warm_guard.py
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from elastic_mnist import agent_link, procs
from elastic_mnist.contract.env import WARM_ADDRESS_ENV, WARM_TOKEN_ENV
from elastic_mnist.rendezvous._warm_start import start_for_workers
from elastic_mnist.warm import _wire

COLD = "elastic-mnist warm start: starting cold: "
# A stand-in whose request is changed by `sys.argv[1]` (Python, on `r`) before it is sent: as a stand-in of
# another version, or a broken one, would send it. It prints where it runs.
STAND_IN = textwrap.dedent("""
    import json, os, sys
    from elastic_mnist.contract.env import WARM_TOKEN_ENV
    from elastic_mnist.contract.warm import Request
    from elastic_mnist.warm import handoff
    real = Request.to_json
    def changed(self):
        r = real(self)
        exec(sys.argv[1], {"r": r})
        return r
    Request.to_json = changed
    handoff()
    print(json.dumps({"pid": os.getpid(), "warm": "ELASTIC_MNIST_STARTED_AT" in os.environ,
                      "token": os.environ.get(WARM_TOKEN_ENV)}), flush=True)
""")


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A warm server of this module (its agent is the test process): its stderr goes to `log`, and `mods`
    is on its import path (and its stand-ins')."""
    here = tmp_path_factory.mktemp("warm")
    log, mods, script = here / "server.log", here / "mods", here / "stand_in.py"
    mods.mkdir()
    script.write_text(STAND_IN)
    path = f"{mods}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    environ: dict[str, str] = {"PYTHONPATH": path}
    saved, fd = os.dup(2), os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)  # the server inherits it; this process's own stderr is back at once
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PYTHONPATH", path)
            server = start_for_workers(agent_link.create(environ), environ)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)
    assert server is not None
    yield SimpleNamespace(env=procs.child_env(**environ), log=log, mods=mods, script=script)
    server.end()


def stand_in(warm, change: str = "", cwd=None) -> tuple[subprocess.CompletedProcess, dict]:
    done = subprocess.run([sys.executable, str(warm.script), change], env=warm.env, cwd=cwd, capture_output=True,
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


DRIBBLER = textwrap.dedent("""
    import socket, struct, sys, time
    from elastic_mnist.warm import _wire
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    body = b'{"argv": ["' + b"x" * 60 + b'"]}'
    socket.send_fds(sock, [struct.pack("!I", len(body))], list(_wire.STDIO))
    print(len(body), flush=True)
    for i in range(len(body)):  # a byte a second: a request that takes a minute
        sock.send(body[i:i + 1])
        time.sleep(1)
""")


def test_a_client_that_dribbles_its_request_holds_no_other_stand_in(warm):
    dribbler = subprocess.Popen([sys.executable, "-c", DRIBBLER, warm.env["ELASTIC_MNIST_WARM"]], env=warm.env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        dribbles_s = int(dribbler.stdout.readline())  # its head is in, its body comes a byte a second
        started = time.monotonic()
        done, seen = stand_in(warm)
        took = time.monotonic() - started
        assert seen["warm"] and done.stderr == ""
        assert took < dribbles_s / 10, f"served after {took:.1f} s beside a request that takes {dribbles_s} s"
        assert dribbler.poll() is None, "the dribbler is still being read meanwhile"
    finally:
        dribbler.kill()
        dribbler.wait()


def test_a_module_the_warm_process_has_not_imported_is_imported_by_the_worker_alone(warm, tmp_path):
    """A preload named by a request would be imported in the warm process's only thread, holding every
    other stand-in of the node meanwhile: the worker imports it itself, after the fork."""
    (warm.mods / "slow_preload.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n"
                                               "import time\ntime.sleep(60)\n")
    started = time.monotonic()
    done, seen = stand_in(warm, "r['preload'] = ['slow_preload']")
    took = time.monotonic() - started
    assert seen["warm"] and done.stderr == "" and took < 6, f"{took:.1f} s"
    assert not (tmp_path / "imported").exists(), "the warm process imported it"


@pytest.mark.parametrize("token", [None, "0" * 32])
def test_a_process_of_the_agent_without_its_token_is_told_nothing_and_logged_once(warm, token):
    """As an orphan re-parented to a PID-1 agent would be: the right user and parent, but not started by the
    agent, so without the token the agent gives its workers. It gets no worker and no answer."""
    env = {k: v for k, v in warm.env.items() if k != WARM_TOKEN_ENV} | ({WARM_TOKEN_ENV: token} if token else {})
    before = warm.log.read_text()
    done, seen = stand_in(SimpleNamespace(env=env, script=warm.script))
    assert not seen["warm"] and done.stderr == "", "it started cold, told nothing"
    logged = warm.log.read_text()[len(before):].splitlines()
    assert logged == [f"elastic-mnist warm start: refused pid {seen['pid']}: its request carries no token of this "
                      "agent (a process the agent did not start: its workers get the token in their environment)"]


def test_the_token_is_handed_to_the_warm_process_only_and_never_to_a_worker(warm):
    """Not among the warm process's arguments (`ps`), nor in the environment a warm worker runs with."""
    token = warm.env[WARM_TOKEN_ENV]
    done, seen = stand_in(warm, "")
    assert seen["warm"] and seen["token"] is None
    server = next(pid for pid in procs.descendants(os.getpid())
                  if b"elastic_mnist.warm.server" in _proc(pid, "cmdline"))
    for where in ("cmdline", "environ"):
        assert token.encode() not in _proc(server, where), where


def _proc(pid: int, what: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return f.read()
    except OSError:  # it ended meanwhile
        return b""


# -- what a wrapper gives the worker's process (ionice, chrt, nice, oom_score_adj, setpriv, unshare) --------
SETTINGS = textwrap.dedent("""
    import json, os
    from elastic_mnist.warm import handoff, settings
    handoff()
    print(json.dumps({"warm": "ELASTIC_MNIST_STARTED_AT" in os.environ, "settings": settings.capture()}))
""")
OOM = ["sh", "-c", 'echo 500 > /proc/self/oom_score_adj && exec "$@"', "sh"]  # raising it needs no privilege


def _under(warm, tmp_path, wrapper: list[str], warm_start: bool) -> tuple[dict, str]:
    script = tmp_path / "settings.py"
    script.write_text(SETTINGS)
    env = warm.env if warm_start else {k: v for k, v in warm.env.items() if k != WARM_ADDRESS_ENV}
    done = subprocess.run([*wrapper, sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_a_warm_worker_keeps_the_io_and_cpu_priority_oom_score_and_no_new_privs_of_its_wrappers(warm, tmp_path):
    wrapper = ["setpriv", "--no-new-privs", "ionice", "-c", "3", "chrt", "--batch", "0", "nice", "-n", "5", *OOM]
    cold, _ = _under(warm, tmp_path, wrapper, warm_start=False)
    seen, err = _under(warm, tmp_path, wrapper, warm_start=True)
    assert seen["warm"] and err == "", err
    assert cold["settings"]["no_new_privs"] and cold["settings"]["oom_score_adj"] == 500, "the wrappers took"
    assert seen["settings"] == cold["settings"], "the warm worker is the cold one's equal"


@pytest.mark.parametrize("wrapper, why", [
    (["unshare", "--net"], "the worker runs in another net namespace than the warm process"),
    (["setpriv", "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"],
     "the worker runs with other capabilities or seccomp than the warm process (CapPrm 0000000000000000"),
])
def test_a_worker_confined_beyond_what_a_fork_can_take_starts_cold_saying_why(warm, tmp_path, wrapper, why):
    if os.geteuid() != 0:
        pytest.skip("a new namespace or dropped capabilities need root (CI runs as root)")
    seen, err = _under(warm, tmp_path, wrapper, warm_start=True)
    [line] = err.splitlines()
    assert not seen["warm"] and line.startswith(f"{COLD}{why}"), err


def test_the_modules_a_script_names_for_its_warm_process_are_read_from_its_source(tmp_path):
    """What a script's handoff() names is imported when the warm process starts (torchrun's plan), not when a
    request names it."""
    from elastic_mnist.contract.warm import WorkerPlan
    from elastic_mnist.warm.plan import request_for

    script = tmp_path / "job.py"
    script.write_text("from elastic_mnist.warm import handoff\nhandoff(preload=('torch', 'json'))\nimport torch\n")
    assert request_for(WorkerPlan({"path": str(script)}, [], str(tmp_path), 1), 0).preload == ["torch", "json"]
    (tmp_path / "plain.py").write_text("import torch\n")
    assert request_for(WorkerPlan({"path": str(tmp_path / "plain.py")}, [], str(tmp_path), 1), 0).preload == []


def test_a_request_is_read_piece_by_piece_and_refused_at_its_deadline(monkeypatch):
    """The inbox itself: a request that comes a few bytes at a time is put together (its descriptors too),
    and one not complete by its deadline is overdue while another is not."""
    import socket
    import struct

    from elastic_mnist.warm import inbox

    box, body = inbox.Inbox(), json.dumps({"token": "t0ken", "argv": ["x"]}).encode()
    box.token, head = b"t0ken", struct.pack("!I", len(body))
    pairs = [socket.socketpair() for _ in range(3)]
    (slow, client), (early, _), (late, _) = pairs
    try:
        assert box.admit(slow, os.getppid()) == "" and box.admit(early, os.getppid()) == ""  # (we are its worker)
        socket.send_fds(client, [head[:2]], list(_wire.STDIO))
        assert box.feed(slow) is None
        for piece in (head[2:], body[:5], body[5:]):
            client.send(piece)
            done = box.feed(slow)
        message, fds = done
        assert message == {"argv": ["x"]} and len(fds) == 3 and slow.fileno() not in box.reading
        for fd in fds:
            os.close(fd)
        monkeypatch.setattr(inbox, "REQUEST_TIMEOUT_S", 0.0)
        box.admit(late, os.getppid())
        assert box.overdue() == [late] and box.timeout() == 0.0
    finally:
        for pair in pairs:
            pair[0].close()
            pair[1].close()


def test_every_message_crosses_the_wire_as_itself_and_anything_else_is_one_error():
    from elastic_mnist.contract import warm

    request = _wire.request_from_here((), 0.0, {})
    sent = [warm.Pid(7), warm.Exit(-9), warm.Refused("no"), warm.Applied(), warm.Ready(), warm.Attach(request),
            warm.Attached(), warm.Detach(0), warm.End("its agent ends")]
    assert {type(m) for m in sent} == set(warm.Message.__args__), "one of each kind"
    a, b = socket.socketpair()
    with a, b:
        for message in sent:
            assert _wire.send(a, message)
            assert _wire.receive(b) == (message, [])
        for bad, why in [({"pid": "7"}, "not a int"), ({"applied": 1}, "with a value"),
                         ({"pid": 1, "exit": 0}, "one key"), ({"sudo": True}, "unknown kind"),
                         ({"attach": {"exe": 1}}, "'exe' missing or not a str")]:
            body = json.dumps(bad).encode()
            a.sendall(struct.pack("!I", len(body)) + body)
            with pytest.raises(_wire.WireError, match=why):
                _wire.receive(b)
