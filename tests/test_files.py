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
    monkeypatch.setattr(files, "random_suffix", lambda: "fixed")
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


# -- read_regular: the bounded reader --------------------------------------------------------------
def _refused(path, limit=64, follow=False) -> str:
    with pytest.raises(files.RefusedFile) as e:
        files.read_regular(path, limit, "the thing", "do the fix", follow_symlinks=follow)
    message = str(e.value)
    assert message.startswith(f"the thing {path} ") and message.endswith("; do the fix") and "\n" not in message
    return e.value.why


def test_read_regular_reads_a_regular_file_up_to_its_cap(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 64)
    assert files.read_regular(path, 64, "the thing", "fix") == b"x" * 64
    assert _refused(path, limit=63) == "is 64 bytes, over its cap of 63"


def test_read_regular_refuses_a_fifo_at_once_instead_of_blocking(tmp_path):
    fifo = tmp_path / "ckpt-000000001.pt"
    os.mkfifo(fifo)  # no writer: a plain open() would block forever
    assert _refused(fifo) == "is a FIFO (named pipe), not a regular file"


def test_read_regular_refuses_devices_directories_and_sockets(tmp_path):
    import socket

    assert _refused("/dev/zero", follow=True) == "is a character device, not a regular file"
    assert _refused(tmp_path) == "is a directory, not a regular file"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    sock.close()
    assert "not a regular file" in _refused(tmp_path / "sock")


def test_read_regular_follows_a_symlink_only_when_asked(tmp_path):
    (tmp_path / "target").write_bytes(b"key")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert _refused(tmp_path / "link") == "is a symbolic link, which is not followed here"
    assert files.read_regular(tmp_path / "link", 64, "the thing", "fix", follow_symlinks=True) == b"key"
    (tmp_path / "zero").symlink_to("/dev/zero")  # followed, the type is still checked
    assert _refused(tmp_path / "zero", follow=True) == "is a character device, not a regular file"


def test_read_regular_passes_other_errors_through(tmp_path):
    with pytest.raises(FileNotFoundError):
        files.read_regular(tmp_path / "missing", 64, "the thing", "fix")


def _stat(mode: int, uid: int, gid: int) -> os.stat_result:
    return os.stat_result((0o100000 | mode, 1, 1, 1, uid, gid, 65, 0, 0, 0))


def test_a_credential_is_trusted_only_when_nobody_else_may_read_or_change_it(monkeypatch):
    from elastic_mnist.files import credential_problem

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getegid", lambda: 1000)
    monkeypatch.setattr(os, "getgroups", lambda: [1000, 2000])
    trusted = [(0o600, 1000, 1000), (0o400, 1000, 1000), (0o600, 0, 0), (0o440, 0, 2000)]  # the last: a Secret
    refused = [(0o644, 1000, 1000), (0o640, 1000, 1000), (0o620, 1000, 1000), (0o606, 1000, 1000),
               (0o440, 0, 3000), (0o444, 0, 2000), (0o460, 0, 2000), (0o600, 1001, 1000)]
    assert [credential_problem("f", _stat(*case)) for case in trusted] == [None] * len(trusted)
    problems = [credential_problem("f", _stat(*case)) for case in refused]
    assert all(p and "chmod 600 f" in p[1] for p in problems), problems
    assert "belongs to uid 1001, not to this user (uid 1000) or root" in problems[-1][0]
