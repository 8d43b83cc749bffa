"""The one atomic-write helper (elastic_mnist.files): whole content or none, nothing left behind.

    python -m pytest -q tests/test_files.py
"""

from __future__ import annotations

import os

import pytest

from elastic_mnist import files


def test_content_lands_whole_in_bytes_text_or_chunks(tmp_path):
    path = tmp_path / "f"
    files.atomic_write(path, b"one")
    assert path.read_bytes() == b"one"
    files.atomic_write(path, "twó\n")
    assert path.read_text() == "twó\n"
    files.atomic_write(path, [b"a", memoryview(b"bc")], 0o600)
    assert path.read_bytes() == b"abc" and (path.stat().st_mode & 0o777) == 0o600
    assert os.listdir(tmp_path) == ["f"], "no temp file left"


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")

    def chunks():
        yield b"new"
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.atomic_write(path, chunks())
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f"]


def test_a_symlink_in_place_of_the_temp_name_is_not_followed(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: "fixed")
    planted = tmp_path / f".f.tmp-{os.getpid()}-{files.threading.get_ident()}-fixed"
    planted.symlink_to(victim)
    with pytest.raises(FileExistsError):
        files.atomic_write(tmp_path / "f", b"x")
    assert victim.read_bytes() == b"keep" and not (tmp_path / "f").exists()


def test_atomic_create_never_replaces(tmp_path):
    path = tmp_path / "token"
    assert files.atomic_create(path, "first\n", 0o600) is True
    assert files.atomic_create(path, "second\n", 0o600) is False
    assert path.read_text() == "first\n" and (path.stat().st_mode & 0o777) == 0o600
    assert os.listdir(tmp_path) == ["token"]
