"""The frame of the bad-input table (docs/bad-input.md): a Row, how its outcome is taken, and the table
it renders to. The rows are in this package's other modules; tests/test_bad_input_table.py runs them.

    cd tests && python -m bad_input     # prints the table docs/bad-input.md holds

A row's `setup(place)` makes the bad input inside the empty directory `place` and returns its target (the
file or directory the input names). The test plants a sentinel file and directory beside the target,
then `attempt(target, ctx)` tries the input the way the runtime meets it and returns an Outcome: the
lines a user sees, and the exit code ("78", "2"), "raises X" (an in-process call: the agent prints our
line, then torch's traceback) or "goes on" (warned, ignored, or fallen back; the run continues).
`line` is that one line with … where it varies (paths, sizes): its pieces must appear in order. A line
that starts with "none" means no line at all (the row's attempt checks what happens instead).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HEADER = ("| flag or file | what is tried | the one line it gets | nothing existing changed | exit code |\n"
          "|---|---|---|---|---|")


@dataclass(frozen=True)
class Outcome:
    lines: list[str]
    code: str


@dataclass(frozen=True)
class Ctx:
    capsys: Any  # pytest's capsys: what the attempt printed
    monkeypatch: Any
    etcd: Any  # an EtcdServer (module-wide, v3 only) for rows with needs="etcd", else None


Setup = Callable[[Path], Path]
Attempt = Callable[[Path, Ctx], Outcome]


@dataclass(frozen=True)
class Row:
    flag: str  # the flag or file, as the doc's first column names it
    tried: str
    line: str
    kept: str  # what the row checks stays as it was, besides the sentinels
    code: str
    setup: Setup
    attempt: Attempt
    needs: str = ""  # "etcd": a real etcd; "root": only root can make the input (CI runs as root)

    @property
    def id(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", f"{self.flag} {self.tried}".lower()).strip("-")[:80]

    def cells(self) -> list[str]:
        fence = "``" if "`" in self.line else "`"  # a line that quotes a command keeps its own backticks
        line = self.line if self.line.startswith("none") else f"{fence}{' ' * (len(fence) - 1)}{self.line}" \
            f"{' ' * (len(fence) - 1)}{fence}"
        return [self.flag, self.tried, line, self.kept, self.code]


def table(rows: list[Row]) -> str:
    return "\n".join([HEADER, *("| " + " | ".join(row.cells()) + " |" for row in rows)])


def matches(pattern: str, line: str) -> bool:
    """Every piece of `pattern` between … appears in `line`, in order."""
    pieces = [re.escape(p) for p in pattern.split("…") if p]
    return re.search(".*?".join(pieces), line, re.DOTALL) is not None


# -- taking outcomes ---------------------------------------------------------------------------------
def raises(exc: type[BaseException], fn: Callable[[], Any]) -> Outcome:
    """fn must raise exc; its message is the line."""
    try:
        fn()
    except exc as e:
        return Outcome(str(e).splitlines(), f"raises {exc.__name__}")
    raise AssertionError(f"no {exc.__name__} was raised")


def worker_exit(fn: Callable[[], Any]) -> Outcome:
    """fn raises the UserError that the worker's main prints as one line and exits on: 78 for a configuration
    error (tests/test_bad_input.py runs that in a real worker; under etcd-v3 it ends the whole job), 69 for a
    NodeLocalError (this node's own; it ends this node only)."""
    from elastic_mnist.contract.errors import NodeLocalError, UserError

    try:
        fn()
    except UserError as e:
        return Outcome(str(e).splitlines(), "69" if isinstance(e, NodeLocalError) else "78")
    raise AssertionError("no UserError was raised")


def cli(ctx: Ctx, argv: list[str]) -> Outcome:
    """`elastic-mnist ARGV` in this process: its exit code and the lines it printed."""
    from elastic_mnist import cli as entry

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    ctx.capsys.readouterr()
    try:
        code = entry.main(argv)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    out = ctx.capsys.readouterr()
    return Outcome([line for line in (out.out + out.err).splitlines() if line.strip()], str(code))


def warned(ctx: Ctx, fn: Callable[[list[str]], Any], check: Callable[[Any], bool]) -> Outcome:
    """fn(warn) goes on, warning through warn or on stderr; check(its result) says it went on right."""
    lines: list[str] = []
    ctx.capsys.readouterr()
    result = fn(lines.append)
    lines += [line for line in ctx.capsys.readouterr().err.splitlines() if line.strip()]
    assert check(result), result
    return Outcome(lines, "goes on")


# -- what must stay as it was ----------------------------------------------------------------------
def plant_sentinels(beside: Path) -> list[Path]:
    (beside / "sentinel.txt").write_text("the user's file\n")
    (beside / "sentinel-dir").mkdir()
    (beside / "sentinel-dir" / "inside.txt").write_text("the user's directory\n")
    return [beside / "sentinel.txt", beside / "sentinel-dir"]


def fingerprint(path: Path) -> dict[str, tuple | None]:
    """Type, mode, owner and content (or link target) of path and everything under it (no link followed)."""
    found: dict[str, tuple | None] = {}
    entries = [str(path)]
    if path.is_dir() and not path.is_symlink():
        for top, dirs, files in os.walk(path):
            entries += [os.path.join(top, name) for name in dirs + files]
    for entry in entries:
        found[entry] = _entry(entry) if os.path.lexists(entry) else None
    return found


def _entry(entry: str) -> tuple:
    st = os.lstat(entry)
    kind = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid)
    if stat.S_ISLNK(st.st_mode):
        return (*kind, os.readlink(entry))
    if stat.S_ISREG(st.st_mode):
        small = st.st_size < 1 << 26  # a sparse giant is compared by size and mtime
        digest = hashlib.sha256(Path(entry).read_bytes()).hexdigest() if small else st.st_mtime_ns
        return (*kind, st.st_size, digest)
    return kind


# -- shared by the rows ------------------------------------------------------------------------------
SECRET = b"s" * 32
UNREACHABLE = "127.0.0.1:9"  # discard: nothing answers, and every row using it fails before any connection


def fifo(name: str) -> Setup:
    def setup(place: Path) -> Path:
        os.mkfifo(place / name)
        return place / name
    return setup


def rdzv(**conf) -> Attempt:
    def attempt(target: Path, ctx: Ctx) -> Outcome:
        from etcd_fixtures import rdzv_params
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        from elastic_mnist.rendezvous import EtcdV3ConfigError

        values = {k: (v(target) if callable(v) else v) for k, v in conf.items()}
        started = time.monotonic()
        outcome = raises(EtcdV3ConfigError, lambda: get_rendezvous_handler(rdzv_params(UNREACHABLE, **values)))
        assert time.monotonic() - started < 5, "refused at once, not after a read or a connection"
        return outcome
    return attempt


def place_itself(place: Path) -> Path:
    return place


def file_with(name: str, data: bytes, mode: int = 0o644) -> Setup:
    def setup(place: Path) -> Path:
        (place / name).write_bytes(data)
        os.chmod(place / name, mode)
        return place / name
    return setup

