"""Network faults between hosts, end to end: `elastic-mnist local --hosts` puts etcd and each node on a host
of its own (a network namespace: own address, host name, /etc/hosts), with the etcd-v3 backend and the
chaos tests' flags. Each test asserts recovery, 0-1 steps redone, the planned batches, and that nothing of
the run is left (namespace, process, /dev/shm snapshot).

    flock /tmp/em-heavy.lock env PYTHONPATH=$PWD python -m pytest -q tests/e2e/test_hosts.py   # root
"""

from __future__ import annotations

import json
import os

import pytest
from netns import assert_gone

from e2e.test_chaos import assert_replays_plan, launch_local, run_local
from elastic_mnist.config import TrainConfig
from elastic_mnist.procs import alive
from elastic_mnist.state import snapshots

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")]


def assert_left_nothing(run_dir, report: dict) -> None:
    assert report["orphans"] == []
    assert not alive(int((run_dir / "etcd.pid").read_text())), "etcd stopped"
    assert_gone(json.loads((run_dir / "hosts.json").read_text())["run_id"])
    shm = snapshots.root_of(TrainConfig().snapshot_dir)
    if shm:
        assert not os.path.exists(os.path.join(shm, f"local-{snapshots.run_name(report['run_id'])}"))


def on_hosts(data: str, run_dir, chaos: str, *extra: str, **kw) -> dict:
    report = run_local(data, run_dir, chaos, "--hosts", *extra, **kw)
    assert_left_nothing(run_dir, report)
    return report


def test_a_host_that_vanishes_is_dropped(small_mnist, tmp_path):
    """Link down first (no reset, no FIN reaches the survivor), then its processes die."""
    report = on_hosts(small_mnist, tmp_path, "vanish:n1@step=25")
    (event,) = report["events"]
    assert (event["kind"], event["world_size_before"], event["world_size_after"]) == ("vanish", 2, 1)
    assert event["steps_redone"] <= 1 and event["recovery_s"] < 20
    assert_replays_plan(tmp_path, 90)


def test_the_rank0_host_of_three_vanishes(small_mnist, tmp_path):
    """The host of rank 0 (and, with torch's store on rank 0's agent, of the rendezvous store) vanishes."""
    report = on_hosts(small_mnist, tmp_path, "vanish:rank0@step=25", nodes=3)
    (event,) = report["events"]
    assert (event["world_size_before"], event["world_size_after"]) == (3, 2)
    assert event["steps_redone"] <= 1 and event["recovery_s"] < 25
    assert_replays_plan(tmp_path, 90)


def test_a_host_cut_from_etcd_leaves_and_its_peer_goes_on(small_mnist, tmp_path):
    """n1 still reaches n0 but not etcd: its agent exits (it cannot keep its rendezvous), n0 trains on alone.
    Training outlasts the agent's etcd timeouts (~10 s): a job that ends first ends at world 2."""
    report = on_hosts(small_mnist, tmp_path, "cut:n1-etcd@step=20", "--no-restart", steps=250, pace=0.1,
                      timeout=300)
    (event,) = report["events"]
    assert (event["kind"], event["node"], event["world_size_after"]) == ("cut", "n1-etcd", 1)
    assert event["steps_redone"] <= 1 and event["recovery_s"] < 30
    n1 = report["nodes"]["n1"]
    # it gives up on etcd after its client's retries (51 s here on a loaded 2-core machine)
    assert n1["exit_code"] != 0 and n1["exited_at"] - event["time"] < 120, "the cut agent exits"
    assert report["nodes"]["n0"]["exit_code"] == 0 and report["summary"]["world_size"] == 1
    assert_replays_plan(tmp_path, 250)


def test_a_4s_link_blip_ends_back_at_world_2(small_mnist, tmp_path):
    run, report = launch_local(small_mnist, tmp_path, "down:n1@step=25,heal@after=4s", "--hosts", steps=150,
                               pace=0.1, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert_left_nothing(tmp_path, report)
    down, heal = report["events"]
    assert (down["kind"], heal["kind"]) == ("down", "heal") and 4 <= heal["time"] - down["time"] < 6
    assert report["summary"]["world_size"] == 2 and report["summary"]["global_step"] == 150, "back at world 2"
    assert all((e["steps_redone"] or 0) <= 1 for e in report["events"])
    assert_replays_plan(tmp_path, 150)

