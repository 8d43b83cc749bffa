"""`elastic-mnist` subcommands; each lives in its own module exposing `main(argv) -> int`.

    elastic-mnist train --data-dir ../shared/data --epochs 1
    elastic-mnist etcd --port 2379
    elastic-mnist local --nodes 2 --max-nodes 4 --chaos 'kill:n1@step=150'
    elastic-mnist status --rdzv-endpoint 127.0.0.1:2379 --rdzv-id job1
"""

from __future__ import annotations

import importlib
import sys

from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.errors import UserError

# Imported lazily: `status`, `etcd` and `startwatch` must not pay for importing torch.
SUBCOMMANDS = {
    "train": ("elastic_mnist.train", "run one elastic DDP worker (under torchrun) or a single process"),
    "etcd": ("elastic_mnist.etcd.cli", "run the embedded etcd for rendezvous"),
    "etcd-auth": ("elastic_mnist.etcd.auth", "set up least-privilege authentication on an etcd (idempotent)"),
    "local": ("elastic_mnist.local.launcher", "embedded etcd + N torchrun nodes on this machine, with fault injection"),
    "status": ("elastic_mnist.ops.status", "rendezvous round, members and latest checkpoint of a job"),
    "preflight": ("elastic_mnist.ops.preflight", "check data, checkpoint storage, etcd and GPU before a node starts"),
    "pod": ("elastic_mnist.ops.pod",
            "a Kubernetes trainer pod's entry process: torchrun under a signal-forwarding PID 1"),
    "startwatch": ("elastic_mnist.ops.startwatch",
                   "the Kubernetes start watchdog: ends trainer pods that cannot start, marks nodes that failed one"),
}


def usage() -> str:
    lines = ["usage: elastic-mnist {" + ",".join(SUBCOMMANDS) + "} [flags...]", "", "subcommands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines.append("\n`elastic-mnist SUBCOMMAND --help` lists a subcommand's flags.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return exit_codes.OK if argv else exit_codes.USAGE
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"elastic-mnist: error: unknown subcommand {name!r}; choose one of {', '.join(SUBCOMMANDS)}",
              file=sys.stderr)
        return exit_codes.USAGE
    module = importlib.import_module(SUBCOMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except UserError as e:
        print(f"elastic-mnist {name}: error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    except KeyboardInterrupt:
        print(f"elastic-mnist {name}: interrupted", file=sys.stderr)
        return exit_codes.INTERRUPTED
