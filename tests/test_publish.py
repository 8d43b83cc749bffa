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

from elastic_mnist.contract.errors import UserError
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
    with pytest.raises(UserError, match=r"ckpts is not writable on this node \(Permission denied\)"):
        checkpoint.ensure_writable(str(tmp_path / "ckpts"))
    assert os.listdir(tmp_path / "ckpts") == []


def _stale_claim(tmp_path, name: str):
    claim = tmp_path / f".{name}.claim"
    claim.touch()
    old = time.time() - publish._STALE_CLAIM_S - 1
    os.utime(claim, (old, old))
    return claim


def test_a_writer_that_judged_a_claim_stale_too_late_leaves_the_live_one_alone(tmp_path):
    # The interleaving that let two writers publish when stale claims were unlinked by name: both stat
    # the dead writer's claim, the first removes it and claims the name, then the second acts.
    path = tmp_path / "ckpt-000000060.pt"
    claim = _stale_claim(tmp_path, path.name)
    stale = publish._identity(os.stat(claim))  # what both writers saw
    assert publish._break_claim(str(claim), stale)
    os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # the first writer's live claim
    assert not publish._break_claim(str(claim), stale), "the second writer must see the name held"
    assert claim.exists()
    second = tmp_path / "second.tmp"
    second.write_bytes(b"second")
    assert not publish._publish_claim(str(second), str(path)) and not path.exists()
    assert leftovers(tmp_path) == [claim.name], "nothing renamed aside is left behind"


def test_exactly_one_of_two_writers_racing_over_a_stale_claim_publishes(tmp_path):
    for round_ in range(40):  # the race window is small: many rounds, each a fresh stale claim
        path = tmp_path / f"ckpt-{round_:09d}.pt"
        _stale_claim(tmp_path, path.name)
        start, results = threading.Barrier(2), {}

        def writer(i: int) -> None:
            tmp = tmp_path / f"{path.name}.{i}.tmp"
            tmp.write_bytes(f"writer {i}".encode())
            start.wait()
            results[i] = publish._publish_claim(str(tmp), str(path))
        threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results.values()) == [False, True], (round_, results)
        winner = next(i for i, ok in results.items() if ok)
        assert path.read_bytes() == f"writer {winner}".encode()
    assert not [n for n in os.listdir(tmp_path) if ".stale-" in n]
