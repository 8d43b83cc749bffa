"""What sharded state costs on this machine, with real gloo processes: per step, keeping this rank's rows and a
ring copy of its neighbour's (state/sharded_sync.py's Keeper); per change (3 ranks -> 2, one lost), the new
round's agreement and reshard in memory, against a DCP checkpoint saved at 3 and loaded at 2 (the storage path).

    python -m bench.reshard --out bench/results/reshard.json   # the 37M-parameter MLP with Adam 3 times, the seed's
    python -m bench.reshard --hidden 512 --layers 1            # one MLP

Times are medians over the ranks that stay. The in-memory path never gathers a whole tensor: a survivor sends
only the rows that change hands (sent_max), and all that crosses the wire (sent_total, what every rank
receives together) is reported over the whole state (moved_over_state).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from bench import machine

WORLD, LOST = 3, 1


def _vm(field: str) -> int:
    """This process's VmRSS or VmHWM (its peak) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def train_step(model, optimizer, step: int, rank: int, batch: int = 64) -> None:
    """One optimizer step of the MLP on this rank's random batch of `step` (seeded by both)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(batch, 784, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    F.nll_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _member(rank: int, store: str, hidden: int, layers: int, out: str) -> None:
    from elastic_mnist.state import sharded_files
    from elastic_mnist.state.sharded_sync import Keeper, agree_sharded
    from elastic_mnist.worker import sharded
    from elastic_mnist.worker.model import build_model
    from elastic_mnist.worker.optim import Adam

    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    stay = [r for r in range(WORLD) if r != LOST]
    new = dist.new_group(stay)
    fp32, cpu = sharded.precision_policy("fp32"), torch.device("cpu")
    model = sharded.shard_blocks(build_model(hidden, 0, layers), sharded.mesh_of(), fp32)
    optimizer = Adam(model.parameters(), lr=1e-3)
    keeper, steps, keeps = None, [], []
    for i in range(4):
        steps.append(_timed(lambda: train_step(model, optimizer, i, rank)))
        rows, replicated = sharded.rows_of(model, optimizer)
        keeper = keeper or Keeper("bench", rank, WORLD)
        specs = sharded.specs_of(model, optimizer)
        keeps.append(_timed(lambda: keeper.advance(i + 1, rows, specs, {"optimizer": replicated})))
    msd, osd = get_state_dict(model, optimizer)
    save_s = _timed(lambda: sharded_files.save(os.path.join(out, "ckpt"), 4, {"model": msd, "optim": osd}, {}))
    state_bytes = sum(t.numel() * t.element_size() for t in rows.values())
    steady, result = _vm("VmRSS"), {}
    if rank != LOST:
        start = time.perf_counter()
        moved = agree_sharded(keeper.steps, stay.index(rank), len(stay), cpu, None, new)
        live = sharded.empty_sharded(lambda: build_model(hidden, 0, layers), sharded.mesh_of(new), fp32, cpu)
        live_opt = Adam(live.parameters(), lr=1e-3)
        sharded.load_rows(live, live_opt, moved.rows, moved.replicated["optimizer"])
        reshard_s = time.perf_counter() - start
        new_share = sum(t.numel() * t.element_size() for t in moved.rows.values())
        peak = _vm("VmHWM")
        first_step_s = _timed(lambda: train_step(live, live_opt, 4, rank))
        load_s = _timed(lambda: _dcp_load(out, hidden, layers, new))
        result = {"reshard_s": reshard_s, "first_step_s": first_step_s, "dcp_load_s": load_s, "sent": moved.sent,
                  "new_share_bytes": new_share, "step_chosen": moved.step}
        result["peak_over_steady"] = peak / steady
    result.update({"rank": rank, "step_s": statistics.median(steps[1:]), "keep_s": statistics.median(keeps[1:]),
                   "dcp_save_s": save_s, "own_state_bytes": state_bytes})
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # as the worker ends: gloo's threads may still hold a collective's tensors at interpreter exit


def _dcp_load(out: str, hidden: int, layers: int, group) -> None:
    """The storage path at the new size: a model wrapped for the new mesh as the in-memory path wraps it (never
    whole), loaded from the DCP save (written a moment ago: its files are likely in the page cache)."""
    from elastic_mnist.state import format as checkpoint
    from elastic_mnist.state import sharded_files
    from elastic_mnist.worker import sharded
    from elastic_mnist.worker.model import build_model
    from elastic_mnist.worker.optim import Adam

    directory = os.path.join(out, "ckpt")
    with open(checkpoint.path_for(directory, 4), "rb") as f:
        state = checkpoint.decode(f.read())
    cpu, fp32 = torch.device("cpu"), sharded.precision_policy("fp32")
    model = sharded.empty_sharded(lambda: build_model(hidden, 1, layers), sharded.mesh_of(group), fp32, cpu)
    optimizer = Adam(model.parameters(), lr=1e-3)
    msd, osd = get_state_dict(model, optimizer)  # initializes Adam's state to load into
    sharded_files.load(directory, state, {"model": msd, "optim": osd}, group)
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)


def measure(hidden: int, layers: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_member, args=(os.path.join(out, "store"), hidden, layers, out), nprocs=WORLD, join=True)
        ranks = [json.load(open(os.path.join(out, f"rank-{r}.json"))) for r in range(WORLD)]
    stayed = [r for r in ranks if "reshard_s" in r]
    med = lambda key, rows=stayed: round(statistics.median(r[key] for r in rows), 4)  # noqa: E731
    result = {"hidden": hidden, "layers": layers, "world": f"{WORLD} -> {WORLD - 1}",
              "state_bytes": sum(r["own_state_bytes"] for r in ranks), "step_s": med("step_s", ranks),
              "keep_s": med("keep_s", ranks), "reshard_s": med("reshard_s"), "first_step_s": med("first_step_s"),
              "dcp_save_s": med("dcp_save_s", ranks), "dcp_load_s": med("dcp_load_s"),
              "sent_max": max(r["sent"] for r in stayed), "sent_total": sum(r["sent"] for r in stayed),
              "new_share_max": max(r["new_share_bytes"] for r in stayed),
              "peak_over_steady_max": round(max(r["peak_over_steady"] for r in stayed), 3),
              "step_chosen": stayed[0]["step_chosen"]}
    result["keep_over_step"] = round(result["keep_s"] / result["step_s"], 3)
    result["reshard_over_dcp_load"] = round(result["reshard_s"] / result["dcp_load_s"], 3)
    # What crosses the wire, all ranks together (what one rank receives is at most this), over the whole state.
    result["moved_over_state"] = round(result["sent_total"] / result["state_bytes"], 3)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.reshard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, help="one MLP's width (default: the 37M-parameter one and the seed's)")
    parser.add_argument("--layers", type=int, default=1, help="its hidden layers")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the 37M-parameter MLP (its keep varies)")
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args(argv)
    shapes = [(args.hidden, args.layers)] if args.hidden else [(4096, 3)] * args.repeats + [(512, 1)]
    cases = []
    for hidden, layers in shapes:
        print(f"reshard bench: {WORLD} gloo processes, MLP {hidden}x{layers}", file=sys.stderr, flush=True)
        cases.append(measure(hidden, layers))
    machine.emit({"cases": cases}, args.out)


if __name__ == "__main__":
    main()
