"""`elastic-mnist local` flag handling: train flags parsed into a TrainConfig once, argv rendered from it."""

from __future__ import annotations

import os

import pytest

from elastic_mnist.config import TrainConfig, parse_args
from elastic_mnist.errors import UserError
from elastic_mnist.launcher import Launcher, given_fields, parse


def _config(*argv: str, run_dir) -> TrainConfig:
    _, config, _, _ = parse(["--run-dir", str(run_dir), *argv])
    return config


@pytest.mark.parametrize("spelling", [["--log-dir=/x/tb"], ["--log-dir", "/x/tb"]])
def test_log_dir_with_or_without_equals_is_the_users(tmp_path, spelling):
    config = _config(*spelling, run_dir=tmp_path)
    assert config.log_dir == "/x/tb", "the user's value, never overridden by the launcher's default"
    assert config.sample_log == str(tmp_path / "samples") and config.checkpoint_dir == str(tmp_path / "checkpoints")


def test_defaults_go_under_the_run_dir(tmp_path):
    config = _config("--max-steps", "5", run_dir=tmp_path)
    assert (config.log_dir, config.sample_log) == (str(tmp_path / "tensorboard"), str(tmp_path / "samples"))
    assert config.max_steps == 5


def test_an_explicit_value_equal_to_the_default_is_still_the_users(tmp_path):
    assert _config("--log-dir=runs", run_dir=tmp_path).log_dir == "runs"
    assert given_fields(["--log-dir=runs", "--no-download", "--lr", "0.1"]) == {"log_dir", "download", "lr"}


def test_to_argv_is_the_inverse_of_the_parser():
    config = TrainConfig(lr=0.5, download=True, sample_log="-odd", log_dir="", max_steps=3, data_dir="/d")
    argv = config.to_argv()
    assert parse_args(argv) == config
    assert "--lr=0.5" in argv and "--download" in argv and not any(a.startswith("--seed") for a in argv)
    assert parse_args(TrainConfig().to_argv()) == TrainConfig() and TrainConfig().to_argv() == []


def _launcher(tmp_path, *argv: str) -> Launcher:
    return Launcher(*parse(["--run-dir", str(tmp_path), *argv]))


def test_each_node_gets_its_own_memory_and_with_local_storage_its_own_disk(tmp_path):
    launcher = _launcher(tmp_path, "--checkpoint-storage", "local")
    n0, n1 = launcher.node_config("n0"), launcher.node_config("n1")
    assert n0.snapshot_dir != n1.snapshot_dir and n0.snapshot_dir.endswith(os.path.join(launcher.run_id, "n0"))
    assert n0.checkpoint_dir == str(tmp_path / "nodes" / "n0" / "checkpoints")
    assert parse_args(n1.to_argv()) == n1, "what a node's torchrun receives rebuilds its config"


def test_a_directory_the_user_sets_is_shared_by_every_node(tmp_path):
    launcher = _launcher(tmp_path, "--checkpoint-storage=local", "--checkpoint-dir=/c", "--snapshot-dir", "/s")
    assert {(c.checkpoint_dir, c.snapshot_dir) for c in map(launcher.node_config, ("n0", "n1"))} == {("/c", "/s")}
    shared = _launcher(tmp_path).node_config("n0")
    assert shared.checkpoint_dir == str(tmp_path / "checkpoints"), "shared storage: one dir for all"


def test_bad_launcher_and_train_flags_are_refused_before_anything_starts(tmp_path, capsys):
    with pytest.raises(UserError, match="--min-nodes"):
        parse(["--run-dir", str(tmp_path), "--nodes", "5", "--max-nodes", "4"])
    with pytest.raises(SystemExit):
        parse(["--run-dir", str(tmp_path), "--epochs", "many"])
    assert "--epochs" in capsys.readouterr().err
    with pytest.raises(UserError, match="smaller than the world size"):
        parse(["--run-dir", str(tmp_path), "--global-batch-size", "2", "--max-nodes", "4"])
    assert not os.listdir(tmp_path), "nothing was created"
