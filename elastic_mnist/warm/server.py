"""The warm process: one per torchrun agent, a single thread that imported torch once and forks the workers.
The agent starts it (rendezvous/_warm_start.py) and it ends with the agent, after its workers; its loop is loop.py.

    python -m elastic_mnist.warm.server --agent PID --address DIR/warm.sock --token-fd FD [--in-place --plan-on-stdin]

Progress goes to --ready-fd as one byte each: listening, warm (torch imported and a fork proven safe), ready
(every local rank's worker built before its round), or failed (one of those ended first).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import socket
import sys

from elastic_mnist.contract.warm import FAILED, LISTENING, PROBE_TIMEOUT_S, READY, WARM, WorkerPlan
from elastic_mnist.warm.loop import Server
from elastic_mnist.warm.plan import request_for

__all__ = ["FAILED", "LISTENING", "READY", "WARM", "main"]
BASE_PRELOAD = ("torch",)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m elastic_mnist.warm.server")
    parser.add_argument("--agent", type=int, required=True, help="the torchrun agent's pid: end when it ends")
    parser.add_argument("--address", required=True, help="the socket path to listen on (in a 0700 directory)")
    parser.add_argument("--ready-fd", type=int, default=-1, help="write the progress marks to this fd")
    parser.add_argument("--token-fd", type=int, required=True, help="read the token every request must carry "
                        "from this fd (the agent hands it to its workers only)")
    parser.add_argument("--control-fd", type=int, default=-1, help="the agent's end of the stream: end then")
    parser.add_argument("--in-place", action="store_true", help="workers may outlive their round (kept.py)")
    parser.add_argument("--plan-on-stdin", action="store_true", help="read the agent's worker (plan.py, JSON) "
                        "from stdin, and fork it before its round")
    parser.add_argument("--preload", action="append", default=[], help="a module to import before forking "
                        "(besides torch and the plan's); a request's other modules are its worker's to import")
    parser.add_argument("--probe-timeout", type=float, default=PROBE_TIMEOUT_S, help="the fork probe's bound")
    args = parser.parse_args(argv)
    # A Ctrl-C, or a SIGTERM to every process of the node, is the agent's to handle: it stops its workers and
    # ends, and this process ends with it, after its workers (their forks reset these).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    plan = WorkerPlan.from_json(json.loads(sys.stdin.read())) if args.plan_on_stdin else None
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # what its forks inherit until a stand-in's stdin replaces it
    try:
        server = Server(args.address, args.agent, args.in_place, plan)
    except ProcessLookupError:
        return  # the agent is gone already
    server.ready_fd, server.preloads.timeout_s = args.ready_fd, args.probe_timeout
    with open(args.token_fd, "rb") as pipe:
        server.inbox.token = pipe.read(1024)
    if args.control_fd >= 0:
        server.control = socket.socket(fileno=args.control_fd)
        server.selector.register(server.control, selectors.EVENT_READ, "control")
    server.mark(LISTENING)
    server.preloads.load([*BASE_PRELOAD, *args.preload, *(request_for(plan, 0).preload if plan else ())])
    server.mark(WARM)
    job = server.prestart()
    if job is None and not server.fleet.building():
        server.mark(READY)  # nothing to build before the round
    job = job or server.serve()
    if job is not None:
        job.run()  # in a forked child only: the worker, from its own __main__
    try:
        os.unlink(args.address)
    except OSError:
        pass


if __name__ == "__main__":
    main()
