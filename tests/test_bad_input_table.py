"""The bad-input table (docs/bad-input.md) as a test: one case per row, and the doc's table must be the rows'.

    python -m pytest -q tests/test_bad_input_table.py
    cd tests && python -m bad_input     # the table to paste into the doc after adding a row

Each row makes its bad input, plants a sentinel file and directory beside the target, tries the input
(in this process where the behaviour allows, real processes where it needs them), and asserts the one
line, the exit code or exception, and that the target and the sentinels are exactly as they were.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bad_input import ROWS
from bad_input.frame import HEADER, Ctx, fingerprint, matches, plant_sentinels, table

from elastic_mnist.etcd.server import EtcdServer

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad-input.md"


@pytest.fixture(scope="module")
def table_etcd():
    """One etcd for every row that needs one (each row uses its own rendezvous id)."""
    with EtcdServer(enable_v2=False) as server:
        yield server


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_row(row, tmp_path, capsys, monkeypatch, request) -> None:
    if row.needs == "root" and os.geteuid() != 0:
        pytest.skip("making a file of another user needs root (CI runs as root)")
    etcd = request.getfixturevalue("table_etcd") if row.needs == "etcd" else None
    place = tmp_path / "place"
    place.mkdir()
    target = row.setup(place)
    sentinels = plant_sentinels(target.parent)
    before = [fingerprint(path) for path in (target, *sentinels)]
    outcome = row.attempt(target, Ctx(capsys, monkeypatch, etcd))
    assert outcome.code == row.code, outcome
    if row.line.startswith("none"):
        assert outcome.lines == [], outcome
    else:
        assert len(outcome.lines) == 1 and matches(row.line, outcome.lines[0]), (row.line, outcome.lines)
    assert [fingerprint(path) for path in (target, *sentinels)] == before, "nothing existing changed"


def test_the_doc_holds_exactly_the_rows() -> None:
    text = DOC.read_text()
    start = text.index(HEADER)
    end = text.find("\n\n", start)
    assert text[start:end if end >= 0 else None].strip() == table(ROWS), \
        "docs/bad-input.md's table differs from the rows: run `cd tests && python -m bad_input`, paste it"


def test_every_row_is_its_own_case() -> None:
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids)), "two rows with one id"
