"""`elastic-mnist status`: a job's rendezvous round, members, waiting nodes and newest checkpoint.

    elastic-mnist status --rdzv-endpoint 127.0.0.1:2379 --rdzv-id job1 --rdzv-backend etcd-v3 \\
        --checkpoint-dir /ckpt [--json]

Reads etcd without joining the job (no heartbeat, no effect on the rendezvous).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone

from elastic_mnist.contract.errors import UserError
from elastic_mnist.contract.rdzv_conf import SCHEMA, parse_conf

__all__ = ["SCHEMA", "build_parser", "collect", "main", "render"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastic-mnist status", description=__doc__.splitlines()[0])
    p.add_argument("--rdzv-endpoint", required=True, help="etcd host:port, as given to torchrun")
    p.add_argument("--rdzv-id", required=True, help="the job's rendezvous id (torchrun --rdzv-id)")
    p.add_argument("--rdzv-backend", choices=["etcd-v3", "etcd"], default="etcd-v3", help="rendezvous backend")
    p.add_argument("--rdzv-conf", default="", help=f"as given to torchrun, the same keys: {', '.join(SCHEMA)} "
                   "(user, password_file and secret_file default to $ELASTIC_MNIST_ETCD_USER, "
                   "$ELASTIC_MNIST_ETCD_PASSWORD_FILE and $ELASTIC_MNIST_RDZV_SECRET_FILE)")
    p.add_argument("--checkpoint-dir", default="", help="also show the newest valid checkpoint there")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout, for scripts")
    return p


def collect(args) -> dict:
    from elastic_mnist.etcd.rdzv_status import read_rendezvous_status

    conn = parse_conf(args.rdzv_conf)
    key_prefix = conn.pop("key_prefix", None)
    try:
        status = read_rendezvous_status(args.rdzv_endpoint, args.rdzv_id, args.rdzv_backend, key_prefix, **conn)
    except UserError:
        raise
    except Exception as e:  # a client library's own error: still one line naming the endpoint
        raise UserError(f"cannot read rendezvous {args.rdzv_id!r} from etcd at {args.rdzv_endpoint}: {e}") from None
    if args.checkpoint_dir:
        from elastic_mnist import job_secret
        from elastic_mnist.state.format import checkpoint_key, describe_latest

        status["checkpoint"] = describe_latest(args.checkpoint_dir, checkpoint_key(job_secret.from_env()))
    return status


def _age(iso: str | None) -> str:
    if not iso:
        return "-"
    seconds = (datetime.now(timezone.utc) - datetime.fromisoformat(iso)).total_seconds()
    return f"{seconds:.1f}s ago"


def render(s: dict) -> str:
    lines = [f"job {s['run_id']} ({s['backend']} at {s['endpoint']})"]
    if not s["found"]:
        lines.append(f"no rendezvous state at {s['key']}: the job has not started, or its id is different")
    else:
        members = s["participants"]
        integrity = f" (state {s['integrity']})" if s.get("integrity") else ""
        lines.append(f"round {s['round']}, {s['phase']}; {len(members)} participant(s){integrity}:")
        lines += [f"  rank {m['rank']}  {m['node'] or '-'}  last heartbeat {_age(m['last_heartbeat'])}"
                  for m in members]
        waiting = s.get("waiting") or []
        count = s.get("num_waiting", len(waiting))
        lines.append(f"waiting to join: {count}" + (f" ({', '.join(waiting)})" if waiting else ""))
        if s.get("config_error"):
            lines.append(f"ended on a configuration error: {s['config_error']}")
    if "checkpoint" in s:
        c = s["checkpoint"]
        lines.append("latest checkpoint: none" if c is None else
                     f"latest checkpoint: step {c['step']} (epoch {c['epoch']}), {c['age_s']:.1f}s old, "
                     f"saved at world size {c['world_size']}: {c['path']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    status = collect(args)
    print(json.dumps(status, indent=2) if args.json else render(status), flush=True)
    return 0
