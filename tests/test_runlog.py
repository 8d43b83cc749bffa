"""The run log: what a worker writes, what readers get back, and the tails that follow a live run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, worker_env

from elastic_mnist.runlog import JsonlTail, LineTail, RunLog, RunTail, events_dir, read_records


def test_every_record_carries_who_wrote_it(tmp_path):
    log = RunLog(str(tmp_path / "logs"), str(tmp_path / "samples"), rank=1, world_size=3, restart=2)
    log.step(7, 0, torch.tensor([4, 5]))
    log.event("eval", step=7, test_accuracy=0.5)
    log.close()
    (sample,) = read_records(str(tmp_path / "samples"))
    (event,) = read_records(events_dir(str(tmp_path / "logs")))
    who = {"rank": 1, "world_size": 3, "restart": 2, "pid": os.getpid()}
    assert sample.items() >= {"step": 7, "epoch": 0, "indices": [4, 5], **who}.items()
    assert event.items() >= {"event": "eval", "step": 7, "test_accuracy": 0.5, **who}.items()
    assert sample["time"] <= event["time"]
    assert os.listdir(tmp_path / "samples") == [f"restart002-rank001-pid{os.getpid()}.jsonl"]


def test_events_are_written_without_a_sample_dir_and_nothing_without_a_log_dir(tmp_path):
    with RunLog(str(tmp_path / "logs"), "", 0, 1, 0) as log:
        log.step(0, 0, torch.tensor([1]))  # no sample dir: a no-op
        log.event("startup")
    assert [e["event"] for e in read_records(events_dir(str(tmp_path / "logs")))] == ["startup"]
    assert sorted(os.listdir(tmp_path / "logs")) == ["events"]
    with RunLog("", str(tmp_path / "s"), 0, 1, 0) as log:
        log.event("startup")  # no log dir: a no-op
        log.step(0, 0, torch.tensor([1]))
    assert os.listdir(tmp_path / "s") and len(read_records(str(tmp_path / "s"))) == 1


@pytest.mark.slow
def test_two_processes_write_two_files_told_apart_by_the_pid_field(tmp_path):
    script = ("import os, sys, torch; from elastic_mnist.runlog import RunLog\n"
              "log = RunLog('', sys.argv[1], 0, 1, 0)\n"
              "log.step(int(sys.argv[2]), 0, torch.tensor([1, 2])); log.close(); print(os.getpid())")
    pids = [int(subprocess.run([sys.executable, "-c", script, str(tmp_path), str(step)], check=True, text=True,
                               capture_output=True, env=worker_env(), cwd=REPO).stdout) for step in (0, 1)]
    tail = RunTail(str(tmp_path), str(tmp_path / "no-logs"))
    tail.poll()
    # a worker round is (pid, round); a process that never went through an in-place round is round 0
    assert sorted(tail.processes) == sorted((pid, 0) for pid in pids)
    assert {key: [r["step"] for r in recs] for key, recs in tail.processes.items()} == {(pids[0], 0): [0],
                                                                                         (pids[1], 0): [1]}


def test_read_records_skips_a_line_a_killed_writer_left_half_written(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"step": 0}\n{"step": 1')
    (tmp_path / "not-a-log.txt").write_text("x\n")
    assert read_records(str(tmp_path)) == [{"step": 0}]
    assert read_records(str(tmp_path / "missing")) == []


def test_line_tail_returns_each_complete_line_once(tmp_path):
    path = tmp_path / "node.log"
    tail = LineTail(str(path))
    assert tail.read() == [], "a file that does not exist yet is empty"
    with open(path, "w") as f:
        f.write("one\ntw")
        f.flush()
        assert tail.read() == ["one"]
        f.write("o\nthree\n")
        f.flush()
        assert tail.read() == ["two", "three"]
        assert tail.read() == []


def test_jsonl_tail_picks_up_files_that_appear_later(tmp_path):
    tail = JsonlTail(str(tmp_path / "d"))
    assert tail.read() == []
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text('{"n": 1}\n')
    assert tail.read() == [{"n": 1}]
    (tmp_path / "d" / "b.jsonl").write_text('{"n": 2}\n')
    with open(tmp_path / "d" / "a.jsonl", "a") as f:
        f.write('{"n": 3}\n')
    assert sorted(r["n"] for r in tail.read()) == [2, 3]


def test_run_tail_follows_steps_world_size_journal_and_rank0(tmp_path):
    samples, logs = str(tmp_path / "s"), str(tmp_path / "l")
    tail = RunTail(samples, logs)
    assert tail.poll() == [] and tail.latest_step == -1 and tail.newest(rank=0) is None
    log = RunLog(logs, samples, rank=0, world_size=2, restart=0)
    for step in range(3):
        log.step(step, 0, torch.tensor([step]))
    log.event("startup", step=0)
    assert len(tail.poll()) == 3
    assert (tail.latest_step, tail.world_size) == (3, 2)
    assert [e["event"] for e in tail.journal] == ["startup"]
    assert tail.newest(rank=0)["step"] == 2 and tail.newest(rank=1) is None
    log.close()


def test_events_are_records_and_the_live_view_picks_them_by_kind(tmp_path, capsys):
    """Metrics.event writes a structured record (every rank) and prints rank 0's line; the live view shows
    rank 0's progress and any rank's warnings from the records' kinds, each once, never by parsing text."""
    from elastic_mnist.local.live import LiveView
    from elastic_mnist.metrics import Metrics

    logs = str(tmp_path / "logs")
    with RunLog(logs, "", 0, 2, 0, node="n0") as log0, RunLog(logs, "", 1, 2, 0, node="n1") as log1:
        m0, m1 = Metrics(0, logs, journal=log0), Metrics(1, logs, journal=log1)
        m0.event("progress", "[train] step 5", step=5, loss=0.5)
        m1.event("progress", "[train] step 5", step=5, loss=0.5)  # rank 1: recorded, not printed
        m1.warn("peer lost near step 5")
        m0.event("peer_lost", step=5, reason="reset")  # a record without a line
    printed = capsys.readouterr()
    assert printed.out.count("[train] step 5") == 1 and "peer lost" in printed.err
    tail = RunTail(str(tmp_path / "samples"), logs)
    records = tail.poll_events()
    assert {(r["event"], r["rank"]) for r in records} == {("progress", 0), ("progress", 1), ("warning", 1),
                                                          ("peer_lost", 0)}
    assert next(r for r in records if r["event"] == "progress" and r["rank"] == 0)["loss"] == 0.5
    LiveView().show(records)
    shown = capsys.readouterr().out.splitlines()
    assert len(shown) == 2 and "[n0] [train] step 5" in shown[0] and "[n1] peer lost near step 5" in shown[1]
    assert tail.poll_events() == [], "each record is handed out once"


def test_a_warning_line_is_one_write(monkeypatch):
    """Workers run unbuffered, where print() writes a line's text and its newline apart: the ranks sharing a
    stderr would interleave their lines. say() writes each line whole, at once."""
    from elastic_mnist import runlog

    class Stream:
        writes: list[str] = []

        def write(self, text: str) -> None:
            self.writes.append(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(runlog.sys, "stderr", Stream())
    runlog.say("[rank 1] snapshots off on this worker: why")
    assert Stream.writes == ["[rank 1] snapshots off on this worker: why\n"]
