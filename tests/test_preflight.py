"""`elastic-mnist preflight`: one line per check, exit 78 for what no retry on any node fixes, 69 for what
this node lacks (GPU, a writable checkpoint dir, /dev/shm), 75 for an etcd that stays unreachable, 0 when
all is well or the job already finished. Real files, real etcd.

    python -m pytest -q tests/test_preflight.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, worker_env

from elastic_mnist.contract.env import NODE_LOCAL_HOLD_ENV
from elastic_mnist.etcd.server import free_port
from elastic_mnist.ops import nodecheck, preflight
from elastic_mnist.ops.preflight import NODE_LOCAL, PERMANENT, TRANSIENT, parse_launch, run_checks


def launch_for(endpoint: str, data: str, ckpt: Path, *extra: str, backend: str = "etcd-v3", wait: float = 5):
    return parse_launch([f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", "--rdzv-id=job1",
                         f"--wait={wait}", "--data-dir", data, "--checkpoint-dir", str(ckpt), "--backend=gloo", *extra])


def checks(launch) -> tuple[int, list[str]]:
    lines: list[str] = []
    return run_checks(launch, say=lines.append), lines


def failed(lines: list[str]) -> list[str]:
    return [line for line in lines if "FAILED" in line]


@pytest.fixture
def etcd_server_v3only(etcd_v3only_wiped):
    """One etcd for the module, emptied before each test (each test's keys are its own)."""
    return etcd_v3only_wiped


def test_the_pods_torchrun_arguments_are_understood_word_for_word():
    launch = parse_launch(["--nnodes=1:3", "--nproc-per-node=1", "--rdzv-backend=etcd", "--rdzv-endpoint=etcd:2379",
                           "--rdzv-id=uid-1", "--rdzv-conf=timeout=600,last_call_timeout=1,protocol=https",
                           "--local-addr=10.0.0.7", "-m", "elastic_mnist.train", "--data-dir=/data/mnist"])
    assert (launch.backend, launch.endpoint, launch.run_id, launch.max_nodes) == ("etcd", "etcd:2379", "uid-1", 3)
    assert launch.conn == {"protocol": "https"} and launch.train_args == ["--data-dir=/data/mnist"]


def test_all_checks_pass_on_a_good_setup(etcd_server_v3only, small_mnist, tmp_path):
    code, lines = checks(launch_for(etcd_server_v3only.endpoint, small_mnist, tmp_path / "ckpt"))
    assert code == 0, lines
    assert [line.split(":")[1].strip() for line in lines] == ["data", "checkpoints", "shm", "device", "etcd"]
    assert all(": ok: " in line for line in lines) and "2000 train, 500 test" in lines[0]
    assert os.listdir(tmp_path / "ckpt") == [], "the publish probe leaves nothing behind"


def test_missing_mnist_is_permanent_and_names_the_file(small_mnist, tmp_path):
    code, lines = checks(launch_for("127.0.0.1:1", str(tmp_path / "nowhere"), tmp_path / "ckpt"))
    assert code == PERMANENT and len(failed(lines)) == 1, lines
    assert "train-images-idx3-ubyte is missing" in failed(lines)[0] and "--data-dir" in failed(lines)[0]


def test_a_truncated_mnist_file_is_permanent(small_mnist, tmp_path):
    data = tmp_path / "mnist"
    raw = data / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for f in Path(small_mnist, "MNIST", "raw").iterdir():
        blob = f.read_bytes()
        (raw / f.name).write_bytes(blob[:-100] if f.name.startswith("t10k-images") else blob)
    code, lines = checks(launch_for("127.0.0.1:1", str(data), tmp_path / "ckpt"))
    assert code == PERMANENT and "cannot be decoded" in failed(lines)[0] and "truncated" in failed(lines)[0], lines


def test_an_unwritable_checkpoint_dir_is_node_local(small_mnist, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, lines = checks(launch_for("127.0.0.1:1", small_mnist, blocker / "ckpt"))
    assert code == NODE_LOCAL != PERMANENT and "checkpoints: FAILED" in failed(lines)[0], lines
    assert "not writable" in failed(lines)[0]
    assert blocker.read_text() == "x"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a node without a GPU")
def test_nccl_without_a_gpu_is_node_local(small_mnist, tmp_path):
    launch = launch_for("127.0.0.1:1", small_mnist, tmp_path / "ckpt", "--backend=nccl")
    code, lines = checks(launch)
    assert code == NODE_LOCAL and "no CUDA device" in failed(lines)[0] and "exit 69" in failed(lines)[0], lines


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/shm is Linux's")
def test_an_unwritable_dev_shm_is_node_local(small_mnist, tmp_path, monkeypatch):
    monkeypatch.setattr(nodecheck, "SHM", str(tmp_path / "no-shm"))  # a /dev/shm that is not there
    code, lines = checks(launch_for("127.0.0.1:1", small_mnist, tmp_path / "ckpt"))
    assert code == NODE_LOCAL and failed(lines)[0].startswith("preflight: shm: FAILED (this node"), lines


OLD_DRIVER = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu Jan 30 2025\nGCC version:  gcc 12\n"
NEW_DRIVER = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder)\n"


def test_the_driver_is_read_from_the_kernel_module_and_checked_against_the_images_cuda():
    assert "driver 570 is older than CUDA 13.0 (this image) needs (580 or newer)" in \
        nodecheck.driver_problem(OLD_DRIVER, "13.0")
    assert nodecheck.driver_problem(NEW_DRIVER, "13.0") is None and nodecheck.driver_problem(OLD_DRIVER, "12.8") is None
    assert nodecheck.driver_problem("", "13.0") is None and nodecheck.driver_problem(OLD_DRIVER, None) is None


def test_a_node_with_an_old_driver_is_node_local_and_holds_its_exit(small_mnist, tmp_path, monkeypatch):
    """The node's driver named in one line, exit 69 after $ELASTIC_MNIST_NODE_LOCAL_HOLD_S (the start
    watchdog marks the node meanwhile), whatever torch makes of the missing device."""
    version = tmp_path / "version"
    version.write_text(OLD_DRIVER)
    monkeypatch.setattr(nodecheck, "NVIDIA_VERSION", str(version))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv(NODE_LOCAL_HOLD_ENV, "0.3")
    start = time.monotonic()
    code, lines = checks(launch_for("127.0.0.1:1", small_mnist, tmp_path / "ckpt", "--backend=nccl"))
    assert code == NODE_LOCAL and time.monotonic() - start >= 0.3, lines
    assert failed(lines) == [failed(lines)[0]] and "preflight: device: FAILED (this node, exit 69)" in failed(lines)[0]
    assert "NVIDIA driver 570" in failed(lines)[0] and lines[-1].startswith("preflight: holding 0s before exit 69")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_with_a_gpu_passes_the_device_check(small_mnist, tmp_path, etcd_server_v3only):
    launch = launch_for(etcd_server_v3only.endpoint, small_mnist, tmp_path / "ckpt", "--backend=nccl")
    code, lines = checks(launch)
    assert code == 0 and "CUDA device(s)" in lines[3], lines


def test_bad_train_flags_are_permanent(tmp_path):
    code, lines = checks(launch_for("127.0.0.1:1", "data", tmp_path, "--max-steps=-3"))
    assert code == PERMANENT and lines[0].startswith("preflight: flags: FAILED"), lines


def test_an_unreachable_etcd_is_retried_then_transient(small_mnist, tmp_path):
    code, lines = checks(launch_for(f"127.0.0.1:{free_port()}", small_mnist, tmp_path / "ckpt", wait=1.5))
    waits = [line for line in lines if "etcd: waiting" in line]
    assert code == TRANSIENT and len(waits) >= 1 and "unreachable" in failed(lines)[0], lines


def test_legacy_backend_needs_the_v2_api(etcd_server_v3only, etcd_server, small_mnist, tmp_path):
    code, lines = checks(launch_for(etcd_server_v3only.endpoint, small_mnist, tmp_path / "a", backend="etcd"))
    assert code == PERMANENT and "--enable-v2" in failed(lines)[0], lines
    code, lines = checks(launch_for(etcd_server.endpoint, small_mnist, tmp_path / "b", backend="etcd"))
    assert code == 0 and "v2 API enabled" in lines[-1], lines


def test_etcd_credentials_from_the_environment(etcd_server_auth, small_mnist, tmp_path, monkeypatch):
    launch = launch_for(etcd_server_auth.endpoint, small_mnist, tmp_path / "ckpt")
    monkeypatch.setenv("ELASTIC_MNIST_ETCD_USER", "elastic-mnist")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    wrong.chmod(0o600)
    monkeypatch.setenv("ELASTIC_MNIST_ETCD_PASSWORD_FILE", str(wrong))
    code, lines = checks(launch)
    assert code == PERMANENT and "wrong user name or password" in failed(lines)[0], lines
    monkeypatch.setenv("ELASTIC_MNIST_ETCD_PASSWORD_FILE", str(etcd_server_auth.credential_file("job-password")))
    code, lines = checks(launch)
    assert code == 0, lines


def test_a_finished_job_needs_nothing_else(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "finished.json").write_text(json.dumps({"step": 900, "total_steps": 900, "test_accuracy": 0.98,
                                                    "run_id": "job1", "time": 0}))
    # No data, no etcd: none of it matters any more.
    code, lines = checks(launch_for("127.0.0.1:1", str(tmp_path / "nowhere"), ckpt))
    assert code == 0 and len(lines) == 1 and "job already finished at step 900/900" in lines[0], lines
    # Asked to train further: the checks run (and here find no data).
    code, lines = checks(launch_for("127.0.0.1:1", str(tmp_path / "nowhere"), ckpt, "--max-steps=2000"))
    assert code == PERMANENT and "data: FAILED" in lines[0], lines


def test_the_command_exits_with_the_permanent_code(tmp_path):
    run = subprocess.run([sys.executable, "-m", "elastic_mnist", "preflight", "--rdzv-endpoint=127.0.0.1:1",
                          "--data-dir", str(tmp_path / "none"), "--checkpoint-dir", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, env=worker_env(), cwd=REPO, timeout=120)
    assert run.returncode == PERMANENT, run.stdout + run.stderr
    assert [line for line in run.stdout.splitlines() if "FAILED" in line], run.stdout


def test_user_and_password_in_rdzv_conf_work_as_in_torchrun(etcd_server_auth, small_mnist, tmp_path, capfd):
    password = etcd_server_auth.credential_file("job-password").read_text().strip()
    launch = launch_for(etcd_server_auth.endpoint, small_mnist, tmp_path / "ckpt",
                        f"--rdzv-conf=join_timeout=600,user=elastic-mnist,password={password}")
    code, lines = checks(launch)
    assert code == 0, lines
    assert "password= in --rdzv-conf is visible" in capfd.readouterr().err, "the same warning as the backend"


def test_an_unknown_rdzv_conf_key_is_refused_in_the_same_words_everywhere(capsys):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_mnist.contract.rdzv_conf import EtcdV3ConfigError
    from elastic_mnist.ops import status
    from elastic_mnist.rendezvous.etcd_v3 import parse_settings

    with pytest.raises(EtcdV3ConfigError) as backend:
        parse_settings(RendezvousParameters("etcd-v3", "127.0.0.1:1", "job1", 1, 1, bogus_key="1"))
    message = str(backend.value)
    assert message.startswith("unknown --rdzv-conf key(s) for etcd-v3: bogus_key; valid keys: ")
    with pytest.raises(EtcdV3ConfigError) as shown:
        status.collect(status.build_parser().parse_args(["--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=job1",
                                                         "--rdzv-conf=bogus_key=1"]))
    assert str(shown.value) == message
    assert preflight.main(["--rdzv-conf=bogus_key=1"]) == PERMANENT
    assert capsys.readouterr().out == f"preflight: flags: FAILED: {message}\n"


def test_backend_preflight_and_status_share_one_schema():
    from elastic_mnist.contract import rdzv_conf as conf
    from elastic_mnist.ops import status
    from elastic_mnist.rendezvous import etcd_v3

    assert etcd_v3.SCHEMA is preflight.SCHEMA is status.SCHEMA is conf.SCHEMA
    assert etcd_v3.VALID_KEYS is conf.VALID_KEYS and "password" in conf.SECRET_KEYS
    assert set(preflight.CONN_KEYS) >= {"user", "password", "password_file", "secret_file"}
