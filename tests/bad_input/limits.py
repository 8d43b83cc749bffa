"""Rows of the bad-input table for inputs that used to get past the checks into training: numbers past what
torch takes, key mismatches on checkpoints, foreign records, data files that are no regular file, and
credential files others may read or change.

    cd tests && python -m bad_input     # the whole table
"""

from __future__ import annotations

import os
from pathlib import Path

from bad_input.frame import Attempt, Ctx, Outcome, Row, Setup, place_itself, worker_exit


def _flag(arg: str) -> Attempt:
    def attempt(target: Path, ctx: Ctx) -> Outcome:
        from elastic_mnist.config import parse_args

        return worker_exit(lambda: parse_args([arg]))
    return attempt


def _record(name: str, data: bytes | None) -> Setup:
    """Another program's file under a record's name (None: a FIFO), beside a good checkpoint of ours."""
    def setup(place: Path) -> Path:
        from elastic_mnist.state import format as checkpoint

        checkpoint.write_durable(checkpoint.path_for(str(place), 5), checkpoint.encode({"step": 5}))
        os.mkfifo(place / name) if data is None else (place / name).write_bytes(data)
        return place / name
    return setup


def _refuse_records(target: Path, ctx: Ctx) -> Outcome:
    from elastic_mnist.state.manager import _refuse_foreign

    return worker_exit(lambda: _refuse_foreign(str(target.parent)))


_FOREIGN_LINE = ("--checkpoint-dir … holds 1 file(s) under names elastic-mnist writes there that it did not write "
                 "(e.g. {}); it never moves, replaces or deletes them: move them away, or pass another "
                 "--checkpoint-dir")

LIMITS = [
    Row("`--seed`", "`100000000000000` (any number past its range: every int and float flag has one)",
        "--seed 100000000000000 is out of range (at most 4294967295); give a smaller value, such as the default 0",
        "nothing written", "78", place_itself, _flag("--seed=100000000000000")),
    Row("`--checkpoint-dir`", "another program's `finished.json` (`{\"done\": true}`)",
        _FOREIGN_LINE.format("finished.json"), "the file and the checkpoint beside it", "78",
        _record("finished.json", b'{"done": true}\n'), _refuse_records),
    Row("`--checkpoint-dir`", "a FIFO named `.generation`", _FOREIGN_LINE.format(".generation"),
        "the FIFO and the checkpoint beside it", "78", _record(".generation", None), _refuse_records),
]
