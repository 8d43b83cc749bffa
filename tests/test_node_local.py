"""A problem of one node only (its own checkpoint dir) ends that node, never the job: the worker's error type and
exit code, the ranks' agreement on it, and the agent that leaves without closing the rendezvous.

    python -m pytest -q tests/test_node_local.py

(tests/e2e/test_one_node.py runs it with real torchrun agents; tests/test_train_process.py as a real worker.)
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from gloo_group import run_group

from elastic_mnist import agent_link
from elastic_mnist.config import TrainConfig
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.env import AGENT_DIR_ENV
from elastic_mnist.contract.errors import NodeLocalError, PeerNodeLocalError, UserError
from elastic_mnist.ops.nodecheck import NodeLocal
from elastic_mnist.rendezvous._verdict import end_the_job_on_config_errors
from elastic_mnist.rendezvous.policy import AgentPolicy
from elastic_mnist.state import sync
from elastic_mnist.state.manager import check_checkpoint_dir


def test_an_unusable_checkpoint_dir_is_this_nodes_problem(tmp_path):
    (tmp_path / "file").write_text("x\n")
    with pytest.raises(NodeLocalError, match=r"not writable on this node \(.*file is a file, not a directory\)"):
        check_checkpoint_dir(TrainConfig(checkpoint_dir=str(tmp_path / "file" / "ckpt")))
    assert (tmp_path / "file").read_text() == "x\n"
    assert NodeLocal is NodeLocalError, "preflight and the worker call it by one name"


def test_a_node_without_the_gpus_for_nccl_is_this_nodes_problem(monkeypatch):
    import torch

    from elastic_mnist import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NodeLocalError, match="none is visible on this node"):
        distributed.pick_backend("nccl", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(NodeLocalError, match=r"local rank 1 has no CUDA GPU on this node \(1 visible\)"):
        distributed.pick_device("nccl", 1, 2)


def test_another_programs_checkpoint_is_the_jobs_on_shared_storage_and_the_nodes_on_local(tmp_path):
    (tmp_path / "ckpt-000000010.pt").write_bytes(b"not ours\n")
    for storage, kind in (("shared", UserError), ("local", NodeLocalError)):
        with pytest.raises(UserError) as found:
            check_checkpoint_dir(TrainConfig(checkpoint_dir=str(tmp_path), checkpoint_storage=storage))
        assert type(found.value) is kind, storage
    assert (tmp_path / "ckpt-000000010.pt").read_bytes() == b"not ours\n"


# Per case, what each of the two ranks found: (error, node-local) and what each then raises.
CASES = [
    ([("ckpt dir gone", True), (None, False)], ["NodeLocalError", "PeerNodeLocalError"]),
    ([("ckpt dir gone", True), ("bad checkpoint", False)], ["UserError", "UserError"]),  # the job's error wins
    ([(None, False), (None, False)], ["none", "none"]),
]


def _agree(rank: int, world: int, out: str) -> None:
    got = []
    for errors, _ in CASES:
        error, local = errors[rank]
        try:
            sync.agree_errors(error, world, local)
            got.append("none")
        except Exception as e:  # noqa: BLE001 - what each rank raised is the result
            got.append(type(e).__name__)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(got, f)


@pytest.mark.slow  # two real processes in a gloo group
def test_the_ranks_agree_whose_problem_it_is(tmp_path):
    run_group(_agree, 2, str(tmp_path))
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [[got[r][i] for r in range(2)] for i in range(len(CASES))] == [expected for _, expected in CASES]


def test_a_lone_rank_with_a_node_local_problem_raises_it():
    with pytest.raises(NodeLocalError):
        sync.agree_errors("mine", 1, node_local=True)
    assert issubclass(PeerNodeLocalError, RuntimeError) and not issubclass(PeerNodeLocalError, UserError)


def test_the_agent_ends_its_node_alone_without_closing_the_rendezvous(tmp_path, capsys):
    calls: list[str] = []
    handler = SimpleNamespace(next_rendezvous=lambda: calls.append("joined"), num_nodes_waiting=lambda: 0,
                              set_closed=lambda: calls.append("closed"), shutdown=lambda: calls.append("shutdown"))
    store = SimpleNamespace(set=lambda *a: calls.append("store"))
    agent_link.report_node_local("checkpoint dir /c is not writable on this node", {AGENT_DIR_ENV:
                                                                                  str(tmp_path)})
    assert agent_link.config_error(str(tmp_path)) is None, "not the job's configuration error"
    layer = end_the_job_on_config_errors(SimpleNamespace(closed=False), store, "job", str(tmp_path), lambda: None)
    AgentPolicy(handler).add("verdict", layer).install()
    with pytest.raises(SystemExit) as ended:
        handler.next_rendezvous()
    assert ended.value.code == exit_codes.NODE_LOCAL
    handler.shutdown()  # what torch's launcher calls as the agent ends: it would close the rendezvous
    assert calls == [], "no store key, no closing, no join"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not writable on this node" in err and "the job goes on" in err
