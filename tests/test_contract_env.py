"""What an agent hands its workers reads back as it was written, and anything else reads as absent.

    python -m pytest tests/test_contract_env.py -q
"""

from __future__ import annotations

from elastic_mnist.contract import env


def test_what_an_agent_writes_reads_back_typed():
    environ: dict[str, str] = {}
    env.set_agent_pid(environ, 4242)
    env.set_agent_dir(environ, "/tmp/agent-x")
    env.set_warm(environ, "/tmp/agent-x/warm.sock", "t0k3n")
    env.set_peer_beacons(environ, {"n1_7_0": "198.18.0.3:4000"})
    env.set_started_at(environ, 1764800000.25)
    assert env.agent_pid(environ) == 4242 and env.agent_dir(environ) == "/tmp/agent-x"
    assert env.peer_beacons(environ) == {"n1_7_0": "198.18.0.3:4000"}
    assert env.started_at(environ) == 1764800000.25
    assert env.take_warm(environ) == ("/tmp/agent-x/warm.sock", "t0k3n")
    assert env.take_warm(environ) == ("", ""), "taken: the worker a stand-in becomes never holds the token"
    assert all(name.startswith(env.PREFIX) for name in environ)


def test_anything_our_agent_does_not_write_reads_as_absent():
    junk = {env.AGENT_PID_ENV: "-1", env.PEER_BEACONS_ENV: "[1, 2]", env.STARTED_AT_ENV: "soon"}
    assert env.agent_pid(junk) is None and env.peer_beacons(junk) == {} and env.started_at(junk) is None
    assert env.agent_dir({}) == "" and env.peer_beacons({env.PEER_BEACONS_ENV: "not json"}) == {}
