"""Publishing checkpoints on filesystems without hard links (Azure Files over SMB, FUSE mounts): the
writer probes each directory once, falls back to renameat2(RENAME_NOREPLACE) or an exclusive-create
claim, and still never overwrites a published file nor leaves a half-written one under its name.

    python -m pytest -q tests/test_publish.py

os.link is made to fail the way such filesystems fail (EPERM, ENOTSUP, EOPNOTSUPP, and EIO from some
FUSE filesystems); everything else is the real filesystem.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

from elastic_mnist.errors import UserError
from elastic_mnist.state import format as checkpoint
from elastic_mnist.state import publish

NO_LINK_ERRNOS = [errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EIO]


@pytest.fixture(autouse=True)
def fresh_probe_cache(monkeypatch):
    monkeypatch.setattr(publish, "_PUBLISH_METHODS", {})


def no_hard_links(monkeypatch, err: int) -> list[str]:
    calls: list[str] = []

    def link(src, dst, *a, **kw):
        calls.append(str(dst))
        raise OSError(err, os.strerror(err), str(dst))
    monkeypatch.setattr(os, "link", link)
    return calls


def no_renameat2(monkeypatch) -> None:
    monkeypatch.setattr(publish, "_renameat2", lambda: None)


def leftovers(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


def test_hard_links_are_used_where_they_work(tmp_path):
    path = str(tmp_path / "ckpt-000000010.pt")
    assert checkpoint.write_durable(path, b"one") and not checkpoint.write_durable(path, b"two")
    assert open(path, "rb").read() == b"one" and publish.method_of(str(tmp_path)) == "link"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("err", NO_LINK_ERRNOS, ids=errno.errorcode.get)
@pytest.mark.parametrize("fallback", ["noreplace", "claim"])
def test_without_hard_links_publish_still_never_clobbers(tmp_path, monkeypatch, err, fallback):
    calls = no_hard_links(monkeypatch, err)
    if fallback == "claim":
        no_renameat2(monkeypatch)
    path = str(tmp_path / "ckpt-000000010.pt")
    assert checkpoint.write_durable(path, b"first")
    assert not checkpoint.write_durable(path, b"late writer")
    assert open(path, "rb").read() == b"first"
    assert publish.method_of(str(tmp_path)) == fallback
    assert len(calls) == 1, "the directory is probed once, then the chosen method is used"
    assert checkpoint.write_durable(str(tmp_path / "ckpt-000000020.pt"), b"next")
    assert len(calls) == 1 and leftovers(tmp_path) == []
    # replace=True (the generation record, the final model) still replaces atomically.
    assert checkpoint.write_durable(path + ".meta", b"a", replace=True)
    assert checkpoint.write_durable(path + ".meta", b"b", replace=True)
    assert open(path + ".meta", "rb").read() == b"b"


def test_a_link_failure_after_the_probe_steps_down_instead_of_failing(tmp_path, monkeypatch):
    assert checkpoint.ensure_writable(str(tmp_path)) == "link"
    no_hard_links(monkeypatch, errno.EIO)  # e.g. a FUSE mount that started refusing links
    no_renameat2(monkeypatch)
    path = str(tmp_path / "ckpt-000000030.pt")
    assert checkpoint.write_durable(path, b"x") and open(path, "rb").read() == b"x"
    assert publish.method_of(str(tmp_path)) == "claim"


def test_other_link_errors_are_not_mistaken_for_missing_support(tmp_path, monkeypatch):
    no_hard_links(monkeypatch, errno.ENOSPC)
    with pytest.raises(OSError) as raised:
        checkpoint.write_durable(str(tmp_path / "ckpt-000000010.pt"), b"x")
    assert raised.value.errno == errno.ENOSPC
    assert not (tmp_path / "ckpt-000000010.pt").exists() and leftovers(tmp_path) == []


def test_claim_publish_has_one_winner_among_racing_writers(tmp_path, monkeypatch):
    no_hard_links(monkeypatch, errno.EPERM)
    no_renameat2(monkeypatch)
    path = str(tmp_path / "ckpt-000000040.pt")
    start, results = threading.Barrier(8), {}

    def writer(i: int) -> None:
        start.wait()
        results[i] = checkpoint.write_durable(path, f"writer {i}".encode() * 1000)
    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, ok in results.items() if ok]
    assert len(winners) == 1, results
    assert open(path, "rb").read() == f"writer {winners[0]}".encode() * 1000
    assert leftovers(tmp_path) == []


def test_a_stale_claim_from_a_dead_writer_does_not_block_the_name_forever(tmp_path, monkeypatch):
    no_hard_links(monkeypatch, errno.EOPNOTSUPP)
    no_renameat2(monkeypatch)
    path = tmp_path / "ckpt-000000050.pt"
    claim = tmp_path / ".ckpt-000000050.pt.claim"
    claim.touch()
    assert not checkpoint.write_durable(str(path), b"x"), "a fresh claim means someone is publishing"
    old = time.time() - publish._STALE_CLAIM_S - 1
    os.utime(claim, (old, old))
    assert checkpoint.write_durable(str(path), b"x") and path.read_bytes() == b"x"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("err", NO_LINK_ERRNOS, ids=errno.errorcode.get)
def test_ensure_writable_exercises_the_publish_step(tmp_path, monkeypatch, err):
    no_hard_links(monkeypatch, err)
    no_renameat2(monkeypatch)
    assert checkpoint.ensure_writable(str(tmp_path / "ckpts")) == "claim"
    assert os.listdir(tmp_path / "ckpts") == []


def test_ensure_writable_names_a_directory_that_cannot_publish(tmp_path, monkeypatch):
    def broken_rename(*_a, **_kw):
        raise OSError(errno.EACCES, "Permission denied")
    no_hard_links(monkeypatch, errno.EPERM)
    no_renameat2(monkeypatch)
    monkeypatch.setattr(os, "rename", broken_rename)
    with pytest.raises(UserError, match=r"ckpts is not writable \(Permission denied\)"):
        checkpoint.ensure_writable(str(tmp_path / "ckpts"))
    assert os.listdir(tmp_path / "ckpts") == []
