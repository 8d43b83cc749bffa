"""Bad input fails at start with one line naming the fix: non-finite float flags, and every kind of
malformed MNIST file, through the parser, `load_split`, a real worker and real preflight (exit 78).

    python -m pytest -q tests/test_bad_input.py
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import REPO, run_train, worker_env

from elastic_mnist.config import POSITIVE, RANGES, TrainConfig, flag_name, parse_args
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.errors import UserError
from elastic_mnist.data.mnist import RAW_FILES, load_split, write_synthetic_mnist

# Derived from the dataclass, so a float field added later is covered without touching this test.
FLOAT_FIELDS = [f.name for f in fields(TrainConfig) if f.type in (float, "float")]


def test_the_float_fields_are_found():
    assert {"lr", "collective_timeout", "peer_timeout", "heartbeat_interval"} <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_a_non_finite_float_flag_is_one_error_naming_it(name, value):
    # `=`: "-inf" alone would be read as an unknown option.
    with pytest.raises(UserError) as e:
        parse_args([f"{flag_name(name)}={value}"])
    message = str(e.value)
    assert message.startswith(f"{flag_name(name)} must be a finite number") and "\n" not in message, message


NUMERIC_FIELDS = [f.name for f in fields(TrainConfig) if f.type in (int, float, "int", "float")]


def test_every_numeric_field_has_a_range():
    assert "seed" in NUMERIC_FIELDS and set(NUMERIC_FIELDS) == set(RANGES), "a new int or float field needs a range"


def _outside(name: str) -> list:
    """A value past each end of the field's range, as the field's type."""
    low, top = RANGES[name]
    kind = type(getattr(TrainConfig(), name))
    return [kind(top * 2 + 1), kind(low if name in POSITIVE else low - 1)]


@pytest.mark.parametrize("name", NUMERIC_FIELDS)
def test_a_number_outside_its_range_is_one_error_naming_it(name):
    for value in _outside(name):
        with pytest.raises(UserError) as e:
            parse_args([f"{flag_name(name)}={value}"])
        message = str(e.value)
        assert message.startswith(f"{flag_name(name)} ") and "\n" not in message and "default" in message, message


def test_the_largest_seed_seeds_torch_and_the_data_plan():
    from elastic_mnist.data.mnist import BatchPlan
    from elastic_mnist.worker.model import build_model

    seed = parse_args([f"--seed={RANGES['seed'][1]}"]).seed
    build_model(8, seed)
    assert len(BatchPlan(100, 10, seed).global_indices(10_000)) == 10, "every epoch's generator takes it"
    with pytest.raises(UserError, match=r"--seed 100000000000000 is out of range \(at most 4294967295\)"):
        parse_args(["--seed=100000000000000"])


# Each malformed file, made from a good generated set: (file, what is done to it).
def _truncate_to(n):
    return lambda p: p.write_bytes(p.read_bytes()[:n])


def _set_byte(at, value):
    def apply(p):
        blob = bytearray(p.read_bytes())
        blob[at] = value
        p.write_bytes(bytes(blob))
    return apply


def _one_label_short(p):
    blob = p.read_bytes()
    n, = struct.unpack_from(">I", blob, 4)
    p.write_bytes(blob[:4] + struct.pack(">I", n - 1) + blob[8:-1])


def _rows_of_784(p):
    """The same bytes under dimensions [N, 784, 1]: the size checks out, the shape does not."""
    blob = p.read_bytes()
    p.write_bytes(blob[:8] + struct.pack(">II", 784, 1) + blob[16:])


def _a_directory(p):
    p.unlink()
    p.mkdir()


def _unreadable(p):
    """A name that cannot be opened, for root too (a mode of 0 stops no root): a socket in its place."""
    p.unlink()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(p))
    sock.close()  # the socket file stays; opening it fails (ENXIO)


IMAGES, LABELS = RAW_FILES[(True, "images")], RAW_FILES[(True, "labels")]
MALFORMED = {
    "3-byte file": (IMAGES, _truncate_to(3)),
    "empty file": (LABELS, _truncate_to(0)),
    "dimension count past the end": (LABELS, _set_byte(3, 200)),
    "header cut inside the dimensions": (IMAGES, _truncate_to(10)),
    "wrong magic": (IMAGES, _set_byte(2, 0x0D)),
    "truncated payload": (IMAGES, lambda p: p.write_bytes(p.read_bytes()[:-100])),
    "labels count not the images count": (LABELS, _one_label_short),
    "label past 9": (LABELS, _set_byte(8, 200)),
    "images of another shape": (IMAGES, _rows_of_784),
    "a directory in the file's place": (LABELS, _a_directory),
    "unreadable": (LABELS, _unreadable),
}


def _bad_set(tmp_path: Path, case: str) -> tuple[Path, Path]:
    """(data root, the bad file): a small good set with one file spoiled as `case` says."""
    root = write_synthetic_mnist(tmp_path / "data", n_train=100, n_test=20)
    name, spoil = MALFORMED[case]
    path = root / "MNIST" / "raw" / name
    spoil(path)
    return root, path


def _tree(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in directory.iterdir()} if directory.exists() else {}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_file_is_one_error_naming_it_and_writes_no_cache(tmp_path, case):
    root = write_synthetic_mnist(tmp_path / "data", n_train=100, n_test=20)
    good_cache, fresh_cache = tmp_path / "good-cache", tmp_path / "fresh-cache"
    load_split(str(root), True, cache_dir=good_cache)  # a good cache, which the bad file must not touch
    before = _tree(good_cache)
    name, spoil = MALFORMED[case]
    spoil(root / "MNIST" / "raw" / name)
    for cache in (good_cache, fresh_cache):
        with pytest.raises(UserError) as e:
            load_split(str(root), True, cache_dir=cache)
        message = str(e.value)
        assert str(root / "MNIST" / "raw" / name) in message and "re-download MNIST" in message, message
        assert "\n" not in message
    assert len(before) == 1 and _tree(good_cache) == before, "the good cache stays as it was"
    assert _tree(fresh_cache) == {}, "no cache is written from a bad file"


@pytest.mark.slow  # a real worker process
def test_the_worker_exits_78_with_one_line(tmp_path):
    root, bad = _bad_set(tmp_path, "3-byte file")
    run = run_train(["--data-dir", str(root), "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir",
                     str(tmp_path / "runs")], ELASTIC_MNIST_CACHE_DIR=str(tmp_path / "cache"))
    assert run.returncode == exit_codes.PERMANENT, run.stderr
    assert run.stderr.strip().count("\n") == 0 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith("elastic-mnist train: error: MNIST file") and str(bad) in run.stderr


@pytest.mark.slow  # a real worker process
def test_a_nan_flag_exits_78_with_one_line(tmp_path):
    run = run_train(["--lr", "nan", "--data-dir", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert run.returncode == exit_codes.PERMANENT, run.stderr
    assert run.stderr.strip().count("\n") == 0 and "Traceback" not in run.stderr, run.stderr
    assert "--lr must be a finite number, got nan" in run.stderr


def test_preflight_exits_78_with_one_line(tmp_path):
    root, bad = _bad_set(tmp_path, "header cut inside the dimensions")
    run = subprocess.run([sys.executable, "-m", "elastic_mnist", "preflight", "--rdzv-endpoint=127.0.0.1:1",
                          "--data-dir", str(root), "--checkpoint-dir", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, env=worker_env(), cwd=REPO, timeout=120)
    assert run.returncode == exit_codes.PERMANENT, run.stdout + run.stderr
    assert run.stdout.count("\n") == 1 and "Traceback" not in run.stderr, run.stdout + run.stderr
    assert run.stdout.startswith("preflight: data: FAILED") and str(bad) in run.stdout, run.stdout


def test_preflight_names_a_directory_in_a_files_place(tmp_path):
    from elastic_mnist.ops.preflight import parse_launch, run_checks

    root, bad = _bad_set(tmp_path, "a directory in the file's place")
    lines: list[str] = []
    code = run_checks(parse_launch(["--data-dir", str(root), "--checkpoint-dir", str(tmp_path / "ckpt")]),
                      say=lines.append)
    assert code == exit_codes.PERMANENT and len(lines) == 1 and str(bad) in lines[0], lines


@pytest.mark.vision
@pytest.mark.parametrize("case", ["3-byte file", "wrong magic"])
def test_the_dataloader_path_names_a_bad_file_too(tmp_path, case):
    from elastic_mnist.data.loader import mnist_dataset

    root, bad = _bad_set(tmp_path, case)
    with pytest.raises(UserError, match="re-download MNIST") as e:
        mnist_dataset(str(root), train=bad.name.startswith("train"))
    assert str(bad) in str(e.value)
