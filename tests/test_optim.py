"""elastic_mnist.worker.optim.Adam against torch.optim.Adam: same bits, same state_dict, no torch._dynamo import.

    .venv/bin/python -m pytest -q tests/test_optim.py
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from elastic_mnist.worker.model import build_model
from elastic_mnist.worker.optim import Adam


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 784, generator=gen), torch.randint(0, 10, (32,), generator=gen)) for _ in range(n)]


def _train(model, optimizer, batches, lr_of_step=lambda step: 1e-3) -> None:
    for step, (x, y) in enumerate(batches):
        for group in optimizer.param_groups:  # as the runtime's learning-rate schedule does
            group["lr"] = lr_of_step(step)
        optimizer.zero_grad(set_to_none=True)
        F.nll_loss(model(x), y, reduction="sum").backward()
        optimizer.step()


def _assert_same(model_a, opt_a, model_b, opt_b) -> None:
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for index, entry in sa["state"].items():
        assert entry.keys() == sb["state"][index].keys()
        for key, value in entry.items():
            other = sb["state"][index][key]
            assert value.dtype == other.dtype and value.device == other.device and torch.equal(value, other), key


def _pair():
    mine, theirs = build_model(512, 0), build_model(512, 0)
    return mine, Adam(mine.parameters(), lr=1e-3), theirs, torch.optim.Adam(theirs.parameters(), lr=1e-3)


def test_thirty_steps_equal_torch_adam_bit_for_bit():
    model, opt, ref_model, ref_opt = _pair()
    batches = _batches(30)
    decay = lambda step: 2e-3 * (1 - step / 40)  # noqa: E731 - a changing lr, set per step like the runtime
    _train(model, opt, batches, decay)
    _train(ref_model, ref_opt, batches, decay)
    _assert_same(model, opt, ref_model, ref_opt)
    assert opt.state_dict()["state"][0]["step"].item() == 30.0


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_state_dicts_move_between_torch_adam_and_ours(direction):
    model, opt, ref_model, ref_opt = _pair()
    src_model, src_opt, dst_model, dst_opt = (
        (ref_model, ref_opt, model, opt) if direction == "torch_to_ours" else (model, opt, ref_model, ref_opt))
    _train(src_model, src_opt, _batches(10))
    dst_model.load_state_dict(src_model.state_dict())
    # A copy, as a checkpoint file is: torch's load_state_dict keeps the very tensors it is given.
    dst_opt.load_state_dict(copy.deepcopy(src_opt.state_dict()))
    _assert_same(model, opt, ref_model, ref_opt)
    more = _batches(10, seed=2)
    _train(model, opt, more)
    _train(ref_model, ref_opt, more)
    _assert_same(model, opt, ref_model, ref_opt)


def test_step_state_is_on_the_cpu_and_state_dict_returns_live_tensors():
    model, opt, _, _ = _pair()
    _train(model, opt, _batches(2))
    entry = opt.state_dict()["state"][0]
    assert entry["step"].device.type == "cpu" and entry["step"].dtype == torch.float32 and entry["step"].dim() == 0
    assert entry["exp_avg"] is opt.state[next(model.parameters())]["exp_avg"]


def test_zero_grad_keeps_or_drops_gradients():
    model, opt, _, _ = _pair()
    F.nll_loss(model(torch.randn(4, 784)), torch.zeros(4, dtype=torch.long)).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


_NO_DYNAMO = """
import sys, torch
import torch.nn.functional as F
from elastic_mnist.worker.model import build_model
from elastic_mnist.worker.optim import Adam
model = build_model(512, 0)
opt = Adam(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # what the runtime's default task builds
scaler = torch.amp.GradScaler("cpu")  # --precision fp16, --grad-clip
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = F.nll_loss(model(torch.randn(8, 784)), torch.zeros(8, dtype=torch.long))
scaler.scale(loss).backward()
scaler.unscale_(opt)
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
scaler.step(opt)
scaler.update()
sched.step()
opt.load_state_dict(opt.state_dict())
opt.zero_grad(set_to_none=True)
assert opt.state_dict()["state"][0]["step"].item() == 1.0
print("dynamo imported:", "torch._dynamo" in sys.modules)
"""


def test_torch_lr_schedulers_drive_it_as_they_drive_torch_adam():
    """A real torch.optim.Optimizer: torch's schedulers accept it, and the lr they set gives the same bits."""
    model, opt, ref_model, ref_opt = _pair()
    assert isinstance(opt, torch.optim.Optimizer)
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=12) for o in (opt, ref_opt)]
    for step, (x, y) in enumerate(_batches(10)):
        for m, o, sched in zip((model, ref_model), (opt, ref_opt), scheds):
            o.zero_grad(set_to_none=True)
            F.nll_loss(m(x), y, reduction="sum").backward()
            o.step()
            sched.step()
    _assert_same(model, opt, ref_model, ref_opt)
    assert scheds[0].state_dict() == scheds[1].state_dict() and scheds[0].last_epoch == 10


def test_no_method_imports_torch_dynamo():
    out = subprocess.run([sys.executable, "-c", _NO_DYNAMO], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "dynamo imported: False"


def _corrupt_shape(sd):
    sd["state"][2]["exp_avg"] = torch.zeros(10, 256)


def _corrupt_count(sd):
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:3]


def _corrupt_groups(sd):
    sd["param_groups"].append(dict(sd["param_groups"][0]))


def _corrupt_option(sd):
    sd["param_groups"][0]["amsgrad"] = True


def _corrupt_entry(sd):
    del sd["state"][1]["exp_avg_sq"]


@pytest.mark.parametrize("corrupt, message", [
    (_corrupt_shape, r"entry 2 has exp_avg of shape \(10, 256\), the parameter has \(10, 512\)"),
    (_corrupt_count, r"group 0 has 3 parameters, this optimizer 4"),
    (_corrupt_groups, r"has 2 parameter group\(s\), this optimizer 1"),
    (_corrupt_option, r"option amsgrad=True"),
    (_corrupt_entry, r"entry 1 lacks \['exp_avg_sq'\]"),
])
def test_a_bad_state_dict_is_refused_and_changes_nothing(corrupt, message):
    model, opt, _, _ = _pair()
    _train(model, opt, _batches(3))
    before = {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}
    groups_before, state_before = opt.param_groups, opt.state
    other_model = build_model(512, 0)
    other = Adam(other_model.parameters(), lr=5e-4)
    _train(other_model, other, _batches(2, seed=3))
    bad = other.state_dict()
    bad = {"state": {i: dict(e) for i, e in bad["state"].items()},
           "param_groups": [dict(g) for g in bad["param_groups"]]}
    corrupt(bad)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(bad)
    assert opt.param_groups is groups_before and opt.state is state_before
    assert opt.param_groups[0]["lr"] == 1e-3
    for i, entry in opt.state_dict()["state"].items():
        assert all(torch.equal(v, before[i][k]) for k, v in entry.items())


def test_not_a_state_dict_is_refused():
    _, opt, _, _ = _pair()
    with pytest.raises(ValueError, match="not an optimizer state_dict"):
        opt.load_state_dict({"model": {}})


def test_loaded_state_is_a_copy_of_what_was_given():
    model, opt, _, _ = _pair()
    _train(model, opt, _batches(2))
    given = opt.state_dict()
    _, fresh, _, _ = _pair()
    fresh.load_state_dict(given)
    given["state"][0]["exp_avg"].add_(1.0)
    given["state"][0]["step"].add_(1.0)
    loaded = fresh.state_dict()["state"][0]
    assert not torch.equal(loaded["exp_avg"], given["state"][0]["exp_avg"]) and loaded["step"].item() == 2.0
