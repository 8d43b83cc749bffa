"""The start watchdog's side of the API: the exact requests it sends, one sweep against a recorded API (each
change once), the heartbeat it leaves on the Job and its alive file, its arguments, and that it needs nothing
beyond the standard library.

    python -m pytest -q tests/test_startwatch_api.py
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import pytest
from k8s_pods import T0, exited, node, pod, running, stuck, terminated, unschedulable
from startwatch_opts import DEADLINE, FAR, LABEL, options, verdict

from elastic_mnist.ops import kubeapi, noderules, startrules, startwatch
from elastic_mnist.ops.startrules import CONFIG_REASONS, IMAGE_REASONS, NODE_MARKED, STUCK, WAITING


def test_the_requests_are_exact():
    p = stuck("ImagePullBackOff")
    v = verdict(p, T0 + 2 + DEADLINE)
    req = startwatch.condition_patch(p, v, T0 + 2 + DEADLINE)
    assert (req.method, req.path) == ("PATCH", "/api/v1/namespaces/elastic-mnist/pods/trainer-0-x7k2p/status")
    assert req.content_type == "application/strategic-merge-patch+json", "conditions merge by type, others stay"
    assert req.body == {"metadata": {"uid": p["metadata"]["uid"]}, "status": {"conditions": [{
        "type": STUCK, "status": "True", "reason": "ImagePullBackOff", "message": v.message,
        "lastTransitionTime": "2026-12-01T12:15:02Z"}]}}
    delete = startwatch.delete_request(p)
    assert (delete.method, delete.path) == ("DELETE", "/api/v1/namespaces/elastic-mnist/pods/trainer-0-x7k2p")
    assert delete.body == {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": p["metadata"]["uid"]}}
    assert startwatch.delete_request(p, force=True).body == dict(delete.body, gracePeriodSeconds=0)
    failed = startwatch.condition_patch(p, v, T0 + 2 + DEADLINE, phase="Failed")
    assert failed.body["status"]["phase"] == "Failed" and failed.body["status"]["conditions"] == \
        req.body["status"]["conditions"]
    beat = startwatch.heartbeat_request("elastic-mnist", "trainer", T0)
    assert (beat.method, beat.path, beat.content_type) == (
        "PATCH", "/apis/batch/v1/namespaces/elastic-mnist/jobs/trainer", "application/merge-patch+json")
    assert beat.body == {"metadata": {"annotations": {"elastic-mnist.io/watchdog-heartbeat": "2026-12-01T12:00:00Z"}}}
    selector = "app.kubernetes.io/component=trainer,app.kubernetes.io/instance=mnist"
    ls = startwatch.list_request("elastic-mnist", selector)
    assert ls.path == ("/api/v1/namespaces/elastic-mnist/pods?labelSelector=app.kubernetes.io%2Fcomponent%3Dtrainer"
                       "%2Capp.kubernetes.io%2Finstance%3Dmnist")
    ev = startwatch.events_request("elastic-mnist")
    assert ev.path == ("/api/v1/namespaces/elastic-mnist/events?fieldSelector=involvedObject.kind%3DPod%2C"
                       "reason%3DFailedMount")
    assert startwatch.nodes_request(LABEL).path == "/api/v1/nodes?labelSelector=avoid.elastic-mnist.io%2Fmnist"
    assert startwatch.nodes_request().path == "/api/v1/nodes"
    mark, unmark = startwatch.label_request("n1", LABEL, "1796140800"), startwatch.label_request("n1", LABEL, None)
    assert (mark.method, mark.path, mark.content_type) == ("PATCH", "/api/v1/nodes/n1", "application/merge-patch+json")
    assert mark.body == {"metadata": {"labels": {LABEL: "1796140800"}}}
    assert json.dumps(unmark.body) == '{"metadata": {"labels": {"avoid.elastic-mnist.io/mnist": null}}}'


class Recorder:
    """The API as answers to what sweep() sends, in order (the requests are the pure builders'): `nodes` are the
    marked ones (the label-selected list), `every_node` the whole list."""

    def __init__(self, pods: list[dict], nodes: list[dict] = (), events: list[dict] = (), every_node: list[dict] = ()):
        self.pods, self.nodes, self.events, self.sent = pods, list(nodes), list(events), []
        self.every_node = list(every_node)

    def send(self, req):
        self.sent.append(req)
        if req.path == "/api/v1/nodes":
            return {"items": self.every_node}
        answers = {"/pods?": self.pods, "/nodes?": self.nodes, "/events?": self.events}
        return {"items": next((v for k, v in answers.items() if k in req.path), [])} if req.method == "GET" else {}


def _changes(api: Recorder) -> list[tuple[str, str]]:
    return [(r.method, "/".join(r.path.rsplit("/", 2)[-2:])) for r in api.sent if r.method != "GET"]


def test_a_sweep_ends_marks_reports_and_unmarks_each_once(capsys):
    stuck_pod = stuck("ImagePullBackOff")
    peer = pod(name="trainer-1-q9z4m", uid="u-1", phase="Running", init=[terminated("preflight", 0, T0 + 20)],
               containers=[running("trainer", T0 + 21)], node="gpu-node-2")
    waiting_pod = unschedulable(name="trainer-2-a1b2c", uid="u-2")
    bad = exited("preflight", 69, name="trainer-3-zz", uid="u-3", node="gpu-node-3")
    old_mark = {"metadata": {"name": "gpu-node-7", "labels": {LABEL: str(int(T0))}}}
    api = Recorder([stuck_pod, peer, waiting_pod, bad], nodes=[old_mark])
    opts = options()
    opts.namespace = "elastic-mnist"
    assert startwatch.sweep(api, opts, T0, FAR) == FAR, "a running peer was seen"
    assert _changes(api) == [("PATCH", "trainer-0-x7k2p/status"), ("DELETE", "pods/trainer-0-x7k2p"),
                             ("PATCH", "trainer-2-a1b2c/status"), ("PATCH", "nodes/gpu-node-3"),
                             ("PATCH", "trainer-3-zz/status"), ("PATCH", "nodes/gpu-node-7")]
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["event"] for r in records] == ["ended", "reported", "node-marked", "node-unmarked"]
    assert records[0]["reason"] == "ImagePullBackOff" and records[0]["waited_s"] == round(FAR - T0 - 2)
    assert records[2]["clear"] == f"kubectl label node gpu-node-3 {LABEL}-"
    # The pod API now shows what was patched: a second sweep repeats nothing.
    waiting_pod["status"]["conditions"].append({"type": WAITING, "status": "True", "reason": "WaitingForCapacity"})
    bad["status"]["conditions"].append({"type": NODE_MARKED, "status": "True"})
    fresh_mark = {"metadata": {"name": "gpu-node-3", "labels": {LABEL: str(int(FAR))}}}
    api2 = Recorder([peer, waiting_pod, bad], nodes=[fresh_mark])
    startwatch.sweep(api2, opts, T0, FAR + 30)
    assert _changes(api2) == []
    opts.dry_run = True
    api3 = Recorder([stuck("ImagePullBackOff")])
    startwatch.sweep(api3, opts, T0, FAR)
    assert _changes(api3) == [] and "dry run" in capsys.readouterr().out


def test_bad_arguments_are_refused_with_one_line(capsys):
    assert startwatch.parse(["--selector=x"]).deadline == 900 > 0
    for bad in (["--deadline=-1"], ["--interval=0"], ["--avoid-for=-5"], ["--node-lost-after=-1"]):
        with pytest.raises(SystemExit):
            startwatch.parse(["--selector=x", *bad])
        assert "must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        startwatch.parse(["--selector=x", "--node-local-exit=preflight"])
    assert "CONTAINER:CODE" in capsys.readouterr().err


def test_the_watchdog_needs_nothing_but_the_standard_library():
    """A small container: no third-party import in its modules, and `elastic-mnist startwatch` starts without torch
    (the project's image has it; the watchdog's 128 MiB would not hold it)."""
    for module in (startwatch, startrules, noderules, kubeapi):
        tree = ast.parse(Path(module.__file__).read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        assert names - {"elastic_mnist"} <= set(sys.stdlib_module_names) | {"__future__"}, names
    code = ("import atexit, sys; atexit.register(lambda: 'torch' in sys.modules and print('torch imported'))\n"
            "from elastic_mnist.cli import main; main(['startwatch', '--help'])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "torch imported" not in run.stdout
    assert run.returncode == 0 and "--avoid-label" in run.stdout and "--node-lost-after" in run.stdout, run.stderr
    assert CONFIG_REASONS > IMAGE_REASONS


class Down(Recorder):
    """The API refusing what `failing` says: its answer to every such request an HTTP error or a lost connection."""

    def __init__(self, *args, failing=lambda req: False, error=None, **kw):
        super().__init__(*args, **kw)
        self.failing, self.error = failing, error or urllib.error.HTTPError("u", 404, "Not Found", {}, None)

    def send(self, req):
        if self.failing(req):
            self.sent.append(req)
            raise self.error
        return super().send(req)


def _watchdog_options(tmp_path, *extra):
    opts = options("--job=trainer", f"--alive-file={tmp_path / 'alive'}", *extra)
    opts.namespace = "elastic-mnist"
    return opts


def test_every_complete_pass_writes_the_heartbeat_on_the_job_and_a_failing_one_only_the_alive_file(tmp_path, capsys):
    """The Job's annotation says when the watchdog last completed a pass; the alive file (the liveness probe) that
    its loop still turns, even while the API does not answer."""
    opts = _watchdog_options(tmp_path)
    api = Down([], failing=lambda req: False)
    beat = startwatch.Heartbeat(api, opts)
    assert startwatch.one_pass(api, opts, beat, T0, T0 + 30) == T0
    assert api.sent[-1] == kubeapi.heartbeat_request("elastic-mnist", "trainer", T0 + 30)
    assert abs(os.stat(tmp_path / "alive").st_mtime - time.time()) < 60
    os.utime(tmp_path / "alive", (0, 0))
    broken = Down([], failing=lambda req: req.method == "GET", error=urllib.error.URLError("connection refused"))
    startwatch.one_pass(broken, opts, startwatch.Heartbeat(broken, opts), T0, T0 + 60)
    assert [r.method for r in broken.sent] == ["GET"], "no heartbeat after a pass that did not complete"
    assert os.stat(tmp_path / "alive").st_mtime > 0, "but the loop turned"
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["event"] == "sweep-failed"


def test_a_heartbeat_that_cannot_be_written_is_said_once_until_it_works_again(tmp_path, capsys):
    opts = _watchdog_options(tmp_path)
    api = Down([], failing=lambda req: "/jobs/" in req.path and api.job_gone)
    api.job_gone = True
    beat = startwatch.Heartbeat(api, opts)
    for now in (T0, T0 + 30, T0 + 60):
        beat.passed(now)
    api.job_gone = False
    beat.passed(T0 + 90)
    api.job_gone = True
    beat.passed(T0 + 120)
    events = [json.loads(line)["event"] for line in capsys.readouterr().out.splitlines()]
    assert events == ["heartbeat-failed", "heartbeat-failed"], events
    assert len([r for r in api.sent if "/jobs/" in r.path]) == 5, "every pass tries"


def test_a_pod_its_lost_node_never_ends_is_made_failed_and_removed_without_its_kubelet(tmp_path):
    """Deleted (the taint-eviction controller), its grace period over for --node-lost-after and its node NotReady as
    long: status phase Failed with the NodeLost condition, then a delete with a grace period of 0, each once."""
    opts = _watchdog_options(tmp_path, "--node-lost-after=300")
    lost = pod(phase="Running", deleting=True, init=[terminated("preflight", 0, T0 + 20)],
               containers=[running("trainer", T0 + 21)])  # deletionTimestamp: T0 + 3600 (grace period's end)
    now = T0 + 3600 + 300
    gone = node("gpu-node-1", ready=False, since=now - 300)
    api = Recorder([lost], every_node=[gone])
    startwatch.sweep(api, opts, T0, now)
    assert _changes(api) == [("PATCH", "trainer-0-x7k2p/status"), ("DELETE", "pods/trainer-0-x7k2p")]
    patch, delete = [r for r in api.sent if r.method != "GET"]
    assert patch.body["status"]["phase"] == "Failed"
    (condition,) = patch.body["status"]["conditions"]
    assert (condition["type"], condition["reason"]) == (startrules.NODE_LOST, "NodeLost")
    assert "node gpu-node-1 has not been Ready for 300s" in condition["message"]
    assert delete.body["gracePeriodSeconds"] == 0 and delete.body["preconditions"] == {"uid": lost["metadata"]["uid"]}
    for early, ready_node in ((now - 1, gone), (now, node("gpu-node-1", ready=False, since=now - 299)),
                              (now, node("gpu-node-1"))):
        api = Recorder([lost], every_node=[ready_node])
        startwatch.sweep(api, opts, T0, early)
        assert _changes(api) == [], "too early, or the node answers: its kubelet ends the pod"
    api = Recorder([lost], every_node=[])
    startwatch.sweep(api, opts, T0, now)
    assert _changes(api) == [], "the Node object is gone: the pod GC's own case (gcOrphaned)"


def test_every_node_is_listed_only_when_a_decision_needs_it(tmp_path):
    opts = _watchdog_options(tmp_path, "--node-lost-after=300")
    quiet = [stuck("ImagePullBackOff"), pod(phase="Running", name="trainer-1-q", uid="u-1", node="gpu-node-2")]
    api = Recorder(quiet)
    startwatch.sweep(api, opts, T0, T0 + 60)
    assert "/api/v1/nodes" not in [r.path for r in api.sent]
    api = Recorder([unschedulable()])
    startwatch.sweep(api, opts, T0 - 86400, T0 + opts.marked_deadline)
    assert [r.path for r in api.sent].count("/api/v1/nodes") == 1, "no trainer running, one waiting: once a pass"


def test_a_sweep_fails_the_job_when_every_node_that_could_take_a_trainer_is_marked(tmp_path):
    opts = _watchdog_options(tmp_path)
    waiting_pod = unschedulable(message="0/2 nodes are available: 2 node(s) didn't match Pod's node affinity.")
    waiting_pod["spec"] = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": LABEL, "operator": "DoesNotExist"}]}]}}}}
    nodes = [node(f"gpu-node-{i}", labels={LABEL: str(int(T0))}) for i in (1, 2)]
    api = Recorder([waiting_pod], nodes=nodes, every_node=nodes)
    startwatch.sweep(api, opts, T0 - 86400, T0 + opts.marked_deadline)
    assert _changes(api) == [("PATCH", "trainer-0-x7k2p/status"), ("DELETE", "pods/trainer-0-x7k2p")]
    condition = api.sent[-2].body["status"]["conditions"][0]
    assert (condition["type"], condition["reason"]) == (startrules.CANNOT_START, "EveryNodeMarked")
    assert "(gpu-node-1, gpu-node-2) is marked avoid.elastic-mnist.io/mnist" in condition["message"]
