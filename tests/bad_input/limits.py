"""Rows of the bad-input table for inputs that used to get past the checks into training: numbers past what
torch takes, key mismatches on checkpoints, foreign records, data files that are no regular file, and
credential files others may read or change.

    cd tests && python -m bad_input     # the whole table
"""

from __future__ import annotations

from pathlib import Path

from bad_input.frame import Attempt, Ctx, Outcome, Row, place_itself, worker_exit


def _flag(arg: str) -> Attempt:
    def attempt(target: Path, ctx: Ctx) -> Outcome:
        from elastic_mnist.config import parse_args

        return worker_exit(lambda: parse_args([arg]))
    return attempt


LIMITS = [
    Row("`--seed`", "`100000000000000` (any number past its range: every int and float flag has one)",
        "--seed 100000000000000 is out of range (at most 4294967295); give a smaller value, such as the default 0",
        "nothing written", "78", place_itself, _flag("--seed=100000000000000")),
]
