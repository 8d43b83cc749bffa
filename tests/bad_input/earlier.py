"""Rows of the bad-input table for the cases tests/test_bad_input.py covers in depth: non-finite float flags
and every kind of malformed MNIST file (the worker and preflight exit 78).

    cd tests && python -m bad_input     # the whole table
"""

from __future__ import annotations

import os
from pathlib import Path

from test_bad_input import MALFORMED

from bad_input.frame import Attempt, Ctx, Outcome, Row, Setup, cli, place_itself, worker_exit


def _spoiled(case: str) -> Setup:
    def setup(place: Path) -> Path:
        from elastic_mnist.data.mnist import write_synthetic_mnist

        root = write_synthetic_mnist(place / "data", n_train=100, n_test=20)
        name, spoil = MALFORMED[case]
        spoil(root / "MNIST" / "raw" / name)
        return root / "MNIST" / "raw" / name
    return setup


def _load(target: Path, ctx: Ctx) -> Outcome:
    from elastic_mnist.data.mnist import load_split

    cache = target.parents[3] / "cache"
    outcome = worker_exit(lambda: load_split(str(target.parents[2]), True, cache_dir=cache))
    assert not cache.exists() or not os.listdir(cache), "no cache is written from a bad file"
    return outcome


def _flag(arg: str) -> Attempt:
    def attempt(target: Path, ctx: Ctx) -> Outcome:
        from elastic_mnist.config import parse_args

        return worker_exit(lambda: parse_args([arg]))
    return attempt


EARLIER = [
    Row("`--lr`", "`nan` (any float flag: `nan`, `inf`, `-inf`)",
        "--lr must be a finite number, got nan; give a number such as the default 0.001", "nothing written", "78",
        place_itself, _flag("--lr=nan")),
    Row("`--collective-timeout`", "`inf`", "--collective-timeout must be a finite number, got inf; give a number "
        "such as the default 60.0", "nothing written", "78", place_itself, _flag("--collective-timeout=inf")),
    *(Row(f"`--data-dir` file `{MALFORMED[case][0]}`", case,
          f"MNIST file …/{MALFORMED[case][0]} …; re-download MNIST or point --data-dir at a good copy",
          "the file; no cache written", "78", _spoiled(case), _load) for case in MALFORMED),
    Row("`elastic-mnist preflight --data-dir`", "a header cut inside the dimensions",
        "preflight: data: FAILED (permanent, exit 78): MNIST file …/train-images-idx3-ubyte cannot be decoded",
        "the file", "78", _spoiled("header cut inside the dimensions"),
        lambda target, ctx: cli(ctx, ["preflight", "--rdzv-endpoint=127.0.0.1:1", "--data-dir",
                                      str(target.parents[2]), "--checkpoint-dir", str(target.parents[3] / "ckpt")])),
]

