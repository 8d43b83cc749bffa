"""A replicated run's state and a sharded run's are one state in two forms: a DDP checkpoint's "model" and
"optimizer" (with a BatchNorm's buffers and two parameter groups) split into one rank's rows and the rest, and
back, read whole as a sharded checkpoint's files give it, loads into a model that is not sharded unchanged.
In one process: the rows of a world of one are the whole tensors (the sharded tests run real groups).

    python -m pytest tests/test_sharded_state.py -q
"""

import pytest
import torch
from torch import nn

from elastic_mnist.state import sharded_files
from elastic_mnist.worker import sharded
from elastic_mnist.worker.optim import Adam


def _trained() -> tuple[nn.Module, Adam]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = Adam([{"params": model[0].parameters()}, {"params": model[3].parameters(), "lr": 0.05}], lr=0.01)
    for _ in range(2):
        model(torch.randn(8, 6)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_a_ddp_state_split_into_rows_and_read_back_whole_is_unchanged():
    model, optimizer = _trained()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": {"last_epoch": 2}}
    rows, rest = sharded.from_whole(state, model, optimizer, world=1, rank=0)
    assert set(rest["model"]["buffers"]) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert rest["scheduler"] == {"last_epoch": 2} and [g["lr"] for g in rest["optimizer"]["groups"]] == [0.01, 0.05]
    # What DCP's files hold of a sharded save, read whole: the rows' tensors under DCP's flattened names.
    whole = {("optim.state." + k[len("optimizer."):] if k.startswith("optimizer.") else k): v for k, v in rows.items()}
    back = sharded_files.to_whole(whole, rest)
    fresh, fresh_opt = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3)), None
    fresh.load_state_dict(back["model"])
    fresh_opt = Adam([{"params": fresh[0].parameters()}, {"params": fresh[3].parameters()}], lr=0.5)
    fresh_opt.load_state_dict(back["optimizer"])
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state["model"].items())
    want, got = state["optimizer"], fresh_opt.state_dict()
    assert got["param_groups"] == want["param_groups"] and sorted(got["state"]) == sorted(want["state"])
    for i, per_param in want["state"].items():
        assert all(torch.equal(got["state"][i][k], v) for k, v in per_param.items()), i
    assert back["scheduler"] == {"last_epoch": 2}


def test_a_rank_takes_only_its_rows_of_each_tensor():
    model, optimizer = _trained()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    parts = [sharded.from_whole(state, model, optimizer, world=3, rank=r)[0] for r in range(3)]
    weight = state["model"]["0.weight"]  # 5 rows over 3 ranks: 2, 2, 1
    assert [p["model.0.weight"].shape[0] for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["model.0.weight"] for p in parts]), weight)
    moments = state["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(torch.cat([p["optimizer.0.weight.exp_avg"] for p in parts]), moments)


def test_an_offer_no_round_could_hold_is_refused():
    from elastic_mnist.state.sharded_sync import Offer, TransferRefused, _decode_offer, _encode_offer

    good = Offer("L", 7, 2, 3, 7)
    assert _decode_offer(_encode_offer(good)) == good and _decode_offer(_encode_offer(Offer())) == Offer()
    for bad in (["L", 7, 3, 3, 7], ["L", 7, 0, 10**12, 7], ["L", 7, 0, 3, 8], ["", 7, 0, 3, 7], ["L", -5, 0, 3, -1]):
        with pytest.raises(TransferRefused, match="same elastic-mnist"):
            _decode_offer(bad)


def test_a_weight_tied_under_two_names_stays_a_parameter():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model[2].weight = model[0].weight  # one parameter, two names in the state dict
    optimizer = Adam(model.parameters(), lr=0.01)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    rows, rest = sharded.from_whole(state, model, optimizer, world=2, rank=1)
    assert rest["model"]["buffers"] == {} and set(rows) == {"model.0.weight", "model.0.bias", "model.2.bias"}
