"""The worker as a real process: resume equivalence (the contract), bad input, accuracy."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, run_train, worker_env

from elastic_mnist import agent_link, procs
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.env import AGENT_DIR_ENV
from elastic_mnist.data.mnist import BatchPlan
from elastic_mnist.etcd.server import free_port
from elastic_mnist.runlog import read_records
from elastic_mnist.state import format as checkpoint

pytestmark = pytest.mark.slow  # real worker processes: the full suite runs them, the fast tier skips them


def _args(data: str, tmp, name: str, *extra: str) -> list[str]:
    return ["--data-dir", data, "--checkpoint-dir", str(tmp / name / "ckpt"), "--log-dir", str(tmp / name / "runs"),
            "--sample-log", str(tmp / name / "samples"), *extra]


def _final_weights(tmp, name: str) -> dict:
    return torch.load(tmp / name / "runs" / "model.pt", weights_only=True)


def test_resume_is_bit_for_bit_equal_to_a_straight_run(small_mnist, tmp_path):
    """N steps straight == k steps, process exit, restart, N-k steps (same weights to the last bit)."""
    common = ("--epochs", "3", "--checkpoint-every", "0")  # 15 steps/epoch on the small set
    straight = run_train(_args(small_mnist, tmp_path, "a", "--max-steps", "20", *common))
    assert straight.returncode == 0, straight.stderr
    first = run_train(_args(small_mnist, tmp_path, "b", "--max-steps", "8", *common))
    assert first.returncode == 0, first.stderr
    second = run_train(_args(small_mnist, tmp_path, "b", "--max-steps", "20", *common))
    assert second.returncode == 0, second.stderr
    assert "[resume] step 8 (epoch 0, position 8)" in second.stdout
    a, b = _final_weights(tmp_path, "a"), _final_weights(tmp_path, "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = sorted(r["step"] for r in read_records(str(tmp_path / "b" / "samples")))
    assert steps == list(range(20)), "no step skipped or repeated across the restart"
    summary = json.loads((tmp_path / "b" / "runs" / "summary.json").read_text())
    assert summary["global_step"] == 20 and summary["restarts"] == 1 and summary["epochs_completed"] == 1


def test_sample_log_matches_the_plan(small_mnist, tmp_path):
    run = run_train(_args(small_mnist, tmp_path, "s", "--max-steps", "6", "--global-batch-size", "50"))
    assert run.returncode == 0, run.stderr
    records = read_records(str(tmp_path / "s" / "samples"))
    plan = BatchPlan(2000, 50, seed=0)
    assert [r["indices"] for r in records] == [plan.global_indices(s).tolist() for s in range(6)]
    assert all(r["world_size"] == 1 and r["rank"] == 0 and r["restart"] == 0 for r in records)


@pytest.mark.parametrize("flags, message", [
    (["--epochs", "0"], "--epochs must be positive"),
    (["--global-batch-size", "-4"], "--global-batch-size must be positive"),
    (["--backend", "mpi"], "--backend must be auto, gloo or nccl"),
])
def test_bad_flags_give_one_line(small_mnist, tmp_path, flags, message):
    run = run_train(_args(small_mnist, tmp_path, "x", *flags))
    assert run.returncode == exit_codes.PERMANENT
    assert run.stderr.strip().count("\n") == 0 and message in run.stderr


def test_missing_data_dir_says_how_to_get_mnist(tmp_path):
    run = run_train(_args(str(tmp_path / "nowhere"), tmp_path, "m"))
    assert run.returncode == exit_codes.PERMANENT and run.stderr.strip().count("\n") == 0
    assert "MNIST not found" in run.stderr and "--download" in run.stderr and "--data-dir" in run.stderr


def test_unwritable_checkpoint_dir_ends_this_node_only(small_mnist, tmp_path):
    """This node's own problem: exit 69, and its line goes to its agent as node-local, not as the job's
    configuration error (which would close the rendezvous for every node)."""
    (tmp_path / "blocker").write_text("a file where a directory should be")
    (tmp_path / "agent").mkdir(mode=0o700)
    args = ["--data-dir", small_mnist, "--checkpoint-dir", str(tmp_path / "blocker" / "ckpt"),
            "--log-dir", str(tmp_path / "runs"), "--max-steps", "2"]
    run = run_train(args, **{AGENT_DIR_ENV: str(tmp_path / "agent")})
    assert run.returncode == exit_codes.NODE_LOCAL and "not writable on this node" in run.stderr
    assert run.stderr.strip().count("\n") == 0
    assert agent_link.node_local(str(tmp_path / "agent")) in run.stderr
    assert agent_link.config_error(str(tmp_path / "agent")) is None
    assert (tmp_path / "blocker").read_text() == "a file where a directory should be"


def test_checkpoint_of_another_config_is_refused_and_kept(small_mnist, tmp_path):
    assert run_train(_args(small_mnist, tmp_path, "c", "--max-steps", "3")).returncode == 0
    before = sorted(os.listdir(tmp_path / "c" / "ckpt"))
    run = run_train(_args(small_mnist, tmp_path, "c", "--max-steps", "6", "--hidden", "64"))
    assert run.returncode == exit_codes.PERMANENT and run.stderr.strip().count("\n") == 0
    assert "hidden 512 (checkpoint) vs 64 (now)" in run.stderr
    deeper = run_train(_args(small_mnist, tmp_path, "c", "--max-steps", "6", "--hidden-layers", "2"))
    assert deeper.returncode == exit_codes.PERMANENT and "hidden_layers 1 (checkpoint) vs 2 (now)" in deeper.stderr
    assert sorted(os.listdir(tmp_path / "c" / "ckpt")) == before
    assert checkpoint.load_latest(str(tmp_path / "c" / "ckpt"))[0]["step"] == 3


def test_a_deeper_mlp_trains_and_resumes(small_mnist, tmp_path):
    deep = ("--hidden", "48", "--hidden-layers", "3")
    assert run_train(_args(small_mnist, tmp_path, "d", "--max-steps", "3", *deep)).returncode == 0
    run = run_train(_args(small_mnist, tmp_path, "d", "--max-steps", "6", *deep))
    assert run.returncode == 0, run.stderr
    assert "[resume] step 3 " in run.stdout
    weights = _final_weights(tmp_path, "d")
    assert [tuple(w.shape) for w in weights.values() if w.dim() == 2] == [(48, 784), (48, 48), (48, 48), (10, 48)]


def test_corrupt_latest_checkpoint_falls_back_and_training_continues(small_mnist, tmp_path):
    assert run_train(_args(small_mnist, tmp_path, "k", "--max-steps", "6", "--checkpoint-every", "3")).returncode == 0
    newest = checkpoint.path_for(str(tmp_path / "k" / "ckpt"), 6)
    with open(newest, "r+b") as f:
        f.truncate(1000)
    run = run_train(_args(small_mnist, tmp_path, "k", "--max-steps", "9", "--checkpoint-every", "3"))
    assert run.returncode == 0, run.stderr
    assert "skipping checkpoint" in run.stderr and "ckpt-000000006.pt" in run.stderr
    assert "[resume] step 3 " in run.stdout


def test_one_epoch_reaches_the_accuracy_bar(mnist_root, tmp_path):
    """Real MNIST: >= 96% after one epoch (the issue's bar); the generated stand-in is easier: >= 95%."""
    root, real = mnist_root
    run = run_train(["--data-dir", root, "--epochs", "1", "--checkpoint-dir", str(tmp_path / "ckpt"),
                     "--log-dir", str(tmp_path / "runs")])
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "runs" / "summary.json").read_text())
    assert summary["epochs_completed"] == 1 and summary["samples_per_s"] > 0
    assert summary["test_accuracy"] >= (0.96 if real else 0.95)
    assert summary["checkpoints_saved"] >= 1 and summary["checkpoint_block_ms_mean"] > 0
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "runs"))


def test_a_resuming_worker_imports_nothing_heavy_it_does_not_use(small_mnist, tmp_path):
    """Every membership change starts new workers: torch._dynamo (which torch.optim.Adam and DDP import,
    a second on this machine), torchvision and matplotlib stay off that path."""
    assert run_train(_args(small_mnist, tmp_path, "i", "--max-steps", "3")).returncode == 0
    run = run_train(_args(small_mnist, tmp_path, "i", "--max-steps", "6"), PYTHONPROFILEIMPORTTIME="1")
    assert run.returncode == 0, run.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" in imported and "elastic_mnist.worker.trainer" in imported, "the import log is read"
    off_path = {"torch._dynamo", "torchvision", "matplotlib"}
    assert not imported & off_path, sorted(imported & off_path)


def _catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler for `sig` (its SigCgt mask in /proc)."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except FileNotFoundError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (sig - 1) & 1)


def test_sigterm_during_start_up_is_a_graceful_stop_whatever_repeats(small_mnist, tmp_path):
    """The handler is in place before torch loads; SIGTERM then (twice: a node-wide signal and the agent's
    forward) ends the process with exit 0, not death by signal, and before anything is loaded: nothing
    trained, nothing saved, nothing to save."""
    worker = _popen_worker(_args(small_mnist, tmp_path, "t"))
    try:
        procs.wait_for(lambda: _catches(worker.pid, signal.SIGTERM), 30, "the stop handler", interval_s=0.002)
        torch_loaded = "libtorch" in open(f"/proc/{worker.pid}/maps").read()
        worker.send_signal(signal.SIGTERM)
        worker.send_signal(signal.SIGTERM)
        out, _ = worker.communicate(timeout=120)
    finally:
        worker.kill()
    assert not torch_loaded, "the handler was installed before torch loaded"
    assert worker.returncode == 0, out
    assert "stop requested during start-up: nothing loaded, nothing to save" in out, "the handler left at once"
    assert not (tmp_path / "t" / "ckpt").exists() or not os.listdir(tmp_path / "t" / "ckpt")


def test_sigterm_while_the_group_forms_exits_at_once_and_loses_nothing(small_mnist, tmp_path):
    """A worker of a 2-rank round whose peer never comes blocks in the group formation (inside C++, where
    no Python handler runs) for --connect-timeout; a preemption notice then ends it within seconds, exit
    0, with the checkpoint it did not load untouched, and the next worker resumes from it."""
    args = _args(small_mnist, tmp_path, "g", "--snapshot-dir", str(tmp_path / "g" / "shm"))
    assert run_train([*args, "--max-steps", "3"]).returncode == 0
    ckpt = tmp_path / "g" / "ckpt"
    before = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}
    port = free_port()
    worker = _popen_worker([*args, "--connect-timeout", "120"], RANK="0", WORLD_SIZE="2", LOCAL_RANK="0",
                           LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:  # rank 0 hosts the round's store: once it listens, the worker waits in the formation
        procs.wait_for(lambda: _listens(port), 60, "the worker's store", interval_s=0.05)
        sent = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        out, _ = worker.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        worker.kill()
    assert worker.returncode == 0, out
    assert took < 5, f"exited {took:.1f} s after SIGTERM (the formation bound is 120 s)"
    assert "stop requested before the process group formed" in out, out
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()} == before, "nothing written"
    resumed = run_train([*args, "--max-steps", "5"])
    assert resumed.returncode == 0 and "[resume] step 3 " in resumed.stdout, resumed.stdout + resumed.stderr


def _popen_worker(args: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "elastic_mnist.train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=worker_env(**env), cwd=REPO)


def _listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_closed_stdout_does_not_end_training(small_mnist, tmp_path):
    """`elastic-mnist train ... | head -2`: the reader is gone before the first progress line; the worker
    trains to the end all the same (its lines go nowhere) and writes its summary."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to the pipe now fails with EPIPE
    try:
        run = subprocess.run([sys.executable, "-m", "elastic_mnist.train",
                              *_args(small_mnist, tmp_path, "p", "--max-steps", "12", "--log-every", "1")],
                             stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300, env=worker_env(),
                             cwd=REPO)
    finally:
        os.close(write_end)
    assert run.returncode == 0, run.stderr
    assert "BrokenPipeError" not in run.stderr
    summary = json.loads((tmp_path / "p" / "runs" / "summary.json").read_text())
    assert summary["global_step"] == 12
