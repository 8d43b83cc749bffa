"""The run log: per-step sample records and the workers' event journal, one JSONL file per process.

    python -c "from elastic_mnist.runlog import read_records; print(len(read_records('runs/local-X/samples')))"

Writer (one per worker process): sample records go to `<sample_dir>/`, events to `<log_dir>/events/`,
each file named restartNNN-rankNNN-pidNNN.jsonl so no two processes share a file. Every record carries
rank, world_size, restart, pid, round (of a worker kept across rounds) and time as fields; readers use those,
never the file name. Readers:
`read_records` for a finished run, `LineTail`/`JsonlTail`/`RunTail` to follow a live one.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from elastic_mnist import volume

if TYPE_CHECKING:  # the launcher reads run logs without importing torch
    import torch

EVENTS = "events"


def say(line: str) -> None:
    """One line to stderr in one write. Workers run unbuffered (PYTHONUNBUFFERED), where print() writes a line's
    text and its newline apart, and the ranks of a node share one stderr: their lines would interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def events_dir(log_dir: str) -> str:
    """Where the event journal of a run with this --log-dir lives."""
    return os.path.join(log_dir, EVENTS)


class RunLog:
    """This worker process's sample records (when sample_dir is set) and events (when log_dir is set)."""

    def __init__(self, log_dir: str, sample_dir: str, rank: int, world_size: int, restart: int, node: str = "",
                 round_index: int = 0):
        """`round_index`: which round of this process the records belong to (a worker kept across rounds
        serves several; `worker_round` names one)."""
        self._fixed = {"rank": rank, "world_size": world_size, "restart": restart, "pid": os.getpid(),
                       "round": round_index, **({"node": node} if node else {})}
        name = f"restart{restart:03d}-rank{rank:03d}-pid{os.getpid()}.jsonl"

        def warn(message: str) -> None:  # not through the journal: it may be what cannot be written
            say(f"[rank {rank}] {message}")
        self._samples = _Appender(sample_dir, name, "sample records", warn) if sample_dir else None
        self._events = _Appender(events_dir(log_dir), name, "the event journal", warn) if log_dir else None

    def step(self, step: int, epoch: int, indices: torch.Tensor) -> None:
        """The dataset indices this rank used for one optimizer step."""
        if self._samples is not None:
            self._write(self._samples, {"step": step, "epoch": epoch, "indices": indices.tolist()})

    def event(self, kind: str, **fields) -> None:
        """A journal entry: start-up phases, evaluations, stops, failures (for the launcher's report)."""
        if self._events is not None:
            self._write(self._events, {"event": kind, **fields})

    def _write(self, appender: _Appender, record: dict) -> None:
        appender.write((json.dumps({**record, **self._fixed, "time": time.time()}) + "\n").encode())

    def close(self) -> None:
        for appender in (self._samples, self._events):
            if appender is not None:
                appender.close()
        self._samples = self._events = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Appender:
    """Whole lines appended to one file of this process (a crash loses no complete line). On a full or
    read-only volume a line is skipped, never left half-written, with one warning for the volume; appending
    resumes when it has room (elastic_mnist/volume.py). Any other error is raised."""

    def __init__(self, directory: str, name: str, what: str, warn: Callable[[str], None]):
        self.directory, self.path, self.what, self.warn = directory, os.path.join(directory, name), what, warn
        self.volume = volume.of(directory)
        self._fd: int | None = None
        self._lock = threading.Lock()
        self.write(b"")  # opened now: a directory that cannot be used at all fails at start, as it should

    def write(self, line: bytes) -> None:
        with self._lock:
            if not self.volume.ready(len(line)):
                return
            try:
                if self._fd is None:
                    os.makedirs(self.directory, exist_ok=True)
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
                if line:
                    self._append(line)
            except OSError as e:
                if volume.room_error(e) is None:
                    raise
                self.volume.failed(f"{self.what} {self.path}", e, self.warn)
                return
            self.volume.written(self.warn)

    def _append(self, line: bytes) -> None:
        written = 0
        try:
            while written < len(line):
                written += os.write(self._fd, line[written:])
        except OSError:
            if written:  # a part of the line went in before the volume filled: take it back out
                os.ftruncate(self._fd, os.fstat(self._fd).st_size - written)
            raise

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_records(directory: str) -> list[dict]:
    """Every record of every *.jsonl file directly in `directory` (empty if it does not exist).

    A line a killed process left half-written is skipped: it never completed."""
    records = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        records += _parse(path.read_bytes().decode(errors="replace").splitlines(keepends=True))
    return records


def _parse(lines: list[str]) -> list[dict]:
    return [json.loads(line) for line in lines if line.endswith("\n") and line.strip()]


class LineTail:
    """The complete lines a growing file gained since the last read; a line still being written waits."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0

    def read(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        return complete.decode(errors="replace").splitlines()


class JsonlTail:
    """New records of every *.jsonl file in a directory, including files that appear later."""

    def __init__(self, directory: str):
        self.directory = directory
        self._tails: dict[str, LineTail] = {}

    def read(self) -> list[dict]:
        try:
            names = sorted(n for n in os.listdir(self.directory) if n.endswith(".jsonl"))
        except FileNotFoundError:
            return []
        records = []
        for name in names:
            tail = self._tails.setdefault(name, LineTail(os.path.join(self.directory, name)))
            records += [json.loads(line) for line in tail.read() if line.strip()]
        return records


def worker_round(record: dict) -> tuple[int, int]:
    """(pid, round): one round of one worker process, the unit a membership change starts and ends."""
    return record["pid"], record.get("round", 0)


class RunTail:
    """Follows a live run: sample records grouped by worker process, the event journal, and the
    newest step and world size (what the local launcher's fault triggers and report need)."""

    def __init__(self, sample_dir: str, log_dir: str):
        self._samples = JsonlTail(sample_dir)
        self._events = JsonlTail(events_dir(log_dir))
        self.processes: dict[tuple[int, int], list[dict]] = {}
        """worker_round -> the sample records of that round of that worker process, in order (a fresh process
        serves one round; a worker kept across rounds one entry per round)."""
        self.journal: list[dict] = []
        self._unseen = 0
        """How many journal records at the end of `journal` no caller of poll_events() has seen yet."""
        self.latest_step = -1
        """Steps completed so far (the highest step index seen + 1)."""
        self.world_size = 0

    def poll(self) -> list[dict]:
        new = self._samples.read()
        for r in new:
            self.processes.setdefault(worker_round(r), []).append(r)
        events = self._events.read()
        self.journal += events
        self._unseen += len(events)
        for r in sorted(new, key=lambda r: r["time"]):
            self.latest_step = max(self.latest_step, r["step"] + 1)
            self.world_size = r["world_size"]
        return new

    def poll_events(self) -> list[dict]:
        """poll(), then the journal records that arrived since the last call."""
        self.poll()
        unseen, self._unseen = self.journal[len(self.journal) - self._unseen:], 0
        return unseen

    def newest(self, rank: int) -> dict | None:
        """The most recent sample record of any process that holds `rank` in its latest record."""
        last = [recs[-1] for recs in self.processes.values() if recs[-1]["rank"] == rank]
        return max(last, key=lambda r: r["time"], default=None)
