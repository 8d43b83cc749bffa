"""`elastic-mnist local` flag handling: train flags parsed into a TrainConfig once, argv rendered from it."""

from __future__ import annotations

import json
import os
import sys

import pytest

from elastic_mnist.config import TrainConfig, given_fields, parse_args
from elastic_mnist.contract.errors import UserError
from elastic_mnist.local.flags import RUN_DIR_MARK, parse
from elastic_mnist.local.launcher import Launcher
from elastic_mnist.local.nodes import Node, restart_delay
from elastic_mnist.procs import child_env
from elastic_mnist.state import snapshots


def _config(*argv: str, run_dir) -> TrainConfig:
    _, config, _, _ = parse(["--run-dir", str(run_dir), *argv])
    return config


@pytest.mark.parametrize("spelling", [["--log-dir=/x/tb"], ["--log-dir", "/x/tb"]])
def test_log_dir_with_or_without_equals_is_the_users(tmp_path, spelling):
    config = _config(*spelling, run_dir=tmp_path)
    assert config.log_dir == "/x/tb", "the user's value, never overridden by the launcher's default"
    assert config.sample_log == str(tmp_path / "samples") and config.checkpoint_dir == str(tmp_path / "checkpoints")


def test_defaults_go_under_the_run_dir(tmp_path):
    config = _config("--max-steps", "5", run_dir=tmp_path)
    assert (config.log_dir, config.sample_log) == (str(tmp_path / "tensorboard"), str(tmp_path / "samples"))
    assert config.max_steps == 5


def test_an_explicit_value_equal_to_the_default_is_still_the_users(tmp_path):
    assert _config("--log-dir=runs", run_dir=tmp_path).log_dir == "runs"
    assert given_fields(["--log-dir=runs", "--no-download", "--lr", "0.1"]) == {"log_dir", "download", "lr"}


def test_to_argv_is_the_inverse_of_the_parser():
    config = TrainConfig(lr=0.5, download=True, sample_log="-odd", log_dir="", max_steps=3, data_dir="/d")
    argv = config.to_argv()
    assert parse_args(argv) == config
    assert "--lr=0.5" in argv and "--download" in argv and not any(a.startswith("--seed") for a in argv)
    assert parse_args(TrainConfig().to_argv()) == TrainConfig() and TrainConfig().to_argv() == []


def _launcher(tmp_path, *argv: str) -> Launcher:
    return Launcher(*parse(["--run-dir", str(tmp_path), *argv]))


def test_each_node_gets_its_own_memory_and_with_local_storage_its_own_disk(tmp_path):
    launcher = _launcher(tmp_path, "--checkpoint-storage", "local")
    n0, n1 = launcher.node_config("n0"), launcher.node_config("n1")
    assert n0.snapshot_dir != n1.snapshot_dir
    assert n0.snapshot_dir.endswith(os.path.join(f"local-{snapshots.run_name(launcher.run_id)}", "n0"))
    assert n0.checkpoint_dir == str(tmp_path / "nodes" / "n0" / "checkpoints")
    assert parse_args(n1.to_argv()) == n1, "what a node's torchrun receives rebuilds its config"


def test_a_directory_the_user_sets_is_shared_by_every_node(tmp_path):
    launcher = _launcher(tmp_path, "--checkpoint-storage=local", "--checkpoint-dir=/c", "--snapshot-dir", "/s")
    assert {(c.checkpoint_dir, c.snapshot_dir) for c in map(launcher.node_config, ("n0", "n1"))} == {("/c", "/s")}
    shared = _launcher(tmp_path).node_config("n0")
    assert shared.checkpoint_dir == str(tmp_path / "checkpoints"), "shared storage: one dir for all"


def test_bad_launcher_and_train_flags_are_refused_before_anything_starts(tmp_path, capsys):
    with pytest.raises(UserError, match="--min-nodes"):
        parse(["--run-dir", str(tmp_path), "--nodes", "5", "--max-nodes", "4"])
    with pytest.raises(UserError, match="argument --epochs: invalid int value: 'many'"):
        parse(["--run-dir", str(tmp_path), "--epochs", "many"])
    with pytest.raises(UserError, match="smaller than the world size"):
        parse(["--run-dir", str(tmp_path), "--global-batch-size", "2", "--max-nodes", "4"])
    with pytest.raises(UserError, match="--nproc-per-node must be 1..64"):
        parse(["--run-dir", str(tmp_path), "--nproc-per-node", "0"])
    assert not os.listdir(tmp_path), "nothing was created"


def test_a_run_dir_the_launcher_did_not_make_is_refused_unchanged(tmp_path):
    (tmp_path / "etcd").mkdir()
    (tmp_path / "etcd" / "member").write_text("someone's etcd data")
    with pytest.raises(UserError, match="already holds files this launcher did not write"):
        parse(["--run-dir", str(tmp_path)])
    assert sorted(os.listdir(tmp_path)) == ["etcd"]
    assert (tmp_path / "etcd" / "member").read_text() == "someone's etcd data"
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / RUN_DIR_MARK).write_text("")
    (ours / "report.json").write_text("{}")
    parse(["--run-dir", str(ours)])  # an earlier run's dir: resumed


def _exited_node(launcher: Launcher, name: str, code: int) -> Node:
    """A real process standing in for a torchrun agent that exits with `code` by itself."""
    node = Node(name, [sys.executable, "-c", f"raise SystemExit({code})"], child_env(), launcher.args.run_dir)
    launcher.nodes[name] = node
    node.start()
    node.proc.wait(timeout=60)
    return node


def test_an_agent_that_exits_with_an_error_is_restarted_after_a_growing_backoff(tmp_path):
    launcher = _launcher(tmp_path)
    node = _exited_node(launcher, "n0", 3)
    first_pid = node.proc.pid
    launcher.supervise(node, now=100.0)
    (event,) = launcher.events
    assert (event.kind, event.node, event.exit_code, event.time) == ("agent-restart", "n0", 3, 100.0)
    launcher.supervise(node, now=100.0 + restart_delay(0) / 2)
    assert node.proc.pid == first_pid and node.restarts == 0, "not before the back-off is over"
    launcher.supervise(node, now=100.0 + restart_delay(0))
    assert node.restarts == 1 and node.proc.pid != first_pid and node.exited_at is None
    assert json.loads((tmp_path / "nodes" / "n0.json").read_text())["pid"] == node.proc.pid
    node.proc.wait(timeout=60)
    launcher.supervise(node, now=200.0)
    assert node.restart_at == 200.0 + restart_delay(1) and restart_delay(1) > restart_delay(0)
    assert [e.exit_code for e in launcher.events] == [3, 3]


@pytest.mark.parametrize("case", ["exit 0", "injected", "--no-restart"])
def test_a_node_that_finished_was_faulted_or_runs_with_no_restart_stays_down(tmp_path, case):
    launcher = _launcher(tmp_path, *(["--no-restart"] if case == "--no-restart" else []))
    node = _exited_node(launcher, "n0", 0 if case == "exit 0" else 1)
    node.injected = case == "injected"
    launcher.supervise(node, now=100.0)
    launcher.supervise(node, now=1000.0)
    assert (node.restarts, node.restart_at, launcher.events) == (0, None, [])
    assert node.exited_at == 100.0


def test_a_pending_restart_is_dropped_once_another_node_finished_the_job(tmp_path):
    launcher = _launcher(tmp_path)
    failed = _exited_node(launcher, "n0", 1)
    launcher.supervise(failed, now=100.0)
    assert failed.restart_at is not None
    launcher.supervise(_exited_node(launcher, "n1", 0), now=100.1)
    launcher.supervise(failed, now=1000.0)
    assert (failed.restarts, failed.restart_at) == (0, None)


def test_host_faults_parse_and_need_hosts(tmp_path):
    from elastic_mnist.local import chaos

    faults = chaos.parse_schedule("vanish:rank0@step=5,cut:n0-n1@step=9,cut:n1>etcd@time=3s,down:n1@step=20,"
                                  "heal@after=4s", hosts=True)
    assert [(f.kind, f.node, f.peer, f.both, f.trigger) for f in faults] == [
        ("vanish", "rank0", None, True, "step"), ("cut", "n0", "n1", True, "step"),
        ("cut", "n1", "etcd", False, "time"), ("down", "n1", None, True, "step"), ("heal", None, None, True, "after")]
    heal = faults[-1]
    assert heal.previous is faults[-2] and not heal.due(10**6, 10**6), "after= counts from the previous fault"
    faults[-2].fired, faults[-2].fired_at = True, 0.0
    assert heal.due(0, 0)
    for bad, why in [("cut:n0@step=1", "two ends"), ("vanish:n0-n1@step=1", "one node"), ("heal:n0@step=1", "no node"),
                     ("cut:n0-n1@step=1.5", "expected")]:
        with pytest.raises(UserError, match=why):
            chaos.parse_schedule(bad, hosts=True)
    with pytest.raises(UserError, match="add --hosts"):
        parse(["--run-dir", str(tmp_path), "--chaos", "vanish:n1@step=5"])
    assert not os.listdir(tmp_path), "nothing was created"


def test_a_change_not_recovered_is_reported_with_its_rendezvous_and_the_nodes_last_line(tmp_path):
    from elastic_mnist.local.live import stuck_line

    log = tmp_path / "n2.log"
    log.write_text("starting\nelastic-mnist etcd-v3: n2: waiting to join\n\n")
    # the shape read_rendezvous_status returns (node ids are torch's host_pid_local)
    status = {"found": True, "round": 7, "phase": "complete", "waiting": ["h_303_0"],
              "participants": [{"node": "h_101_0", "rank": 0}, {"node": "h_202_0", "rank": 1}]}
    line = stuck_line("join", "n2", 61.4, 2, status, {101: "n0", 202: "n1", 303: "n2"}, str(log))
    assert line == ("join n2 not recovered after 61s (world 2); rendezvous round 7 complete: members [n0,n1], "
                    "waiting [n2]; n2's last log line: elastic-mnist etcd-v3: n2: waiting to join")
    unread = stuck_line("kill", "n1", 60, 3, None, {}, str(tmp_path / "missing.log"))
    assert unread == ("kill n1 not recovered after 60s (world 3); "
                      "rendezvous state not readable (--hosts, or not etcd-v3)")
