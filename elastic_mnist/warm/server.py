"""The warm process: one per torchrun agent, a single thread that imported torch once and forks a child per
worker start. The agent starts it (`start_for_workers`, from the etcd-v3 handler) and it ends with the agent.

    python -m elastic_mnist.warm.server --agent PID --address @NAME    # what start_for_workers runs

fork() is safe here because this process never runs a torch op, starts no thread of its own and never
touches CUDA (checked before every fork: a child of a process with a CUDA context cannot use CUDA). Each
child makes its own CUDA context, process group and data, as a cold worker would.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import select
import selectors
import signal
import socket
import subprocess
import sys

from elastic_mnist import procs
from elastic_mnist.warm import _wire
from elastic_mnist.warm.child import Job

BASE_PRELOAD = ("torch",)
READY_TIMEOUT_S = 10.0
WARM_TIMEOUT_S = 120.0
LISTENING, WARM = b"1", b"2"  # what the warm process writes to its --ready-fd, in this order
REQUEST_TIMEOUT_S = 10.0


class Server:
    """Accepts stand-ins, forks their children, reports each child's exit to its stand-in."""

    def __init__(self, address: str, agent_pid: int) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(_wire.sockaddr(address))
        self.listener.listen(64)  # bound before the imports: a stand-in that comes early waits, not fails
        self.agent = os.pidfd_open(agent_pid)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.agent, selectors.EVENT_READ, "agent")
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
        self.failed: set[str] = set()

    def serve(self) -> Job | None:
        """Until the agent is gone (None); in a forked child, returns that child's job."""
        while True:
            for key, _ in self.selector.select():
                if key.data == "agent":
                    return None
                if key.data == "accept":
                    job = self._accept()
                    if job is not None:
                        return job
                else:
                    self._reap(key.fd)

    def _accept(self) -> Job | None:
        conn, _ = self.listener.accept()
        try:
            if _wire.peer_uid(conn) != os.getuid():
                raise ValueError("another user")
            conn.settimeout(REQUEST_TIMEOUT_S)  # a stand-in that stalls mid-request cannot stall the others
            request, fds = _wire.recv_request(conn)
            conn.settimeout(None)  # before the fork: the child's watch on this connection must never time out
        except (OSError, ValueError):
            conn.close()
            return None
        refused = self._refusal(request)
        if not refused:
            self._import(request.get("preload", []))  # once per node: later children find them imported
            refused = _cuda_refusal()
        if refused or _gone(conn):
            _wire.send_line(conn, {"refused": refused or "gone"})
            _close(fds, conn)
            return None
        server_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._close_in_child(conn)
            return Job(request, fds, conn, server_pid)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, conn)
        self.selector.register(pidfd, selectors.EVENT_READ, "child")
        _wire.send_line(conn, {"pid": pid})
        return None

    def _refusal(self, request: dict) -> str:
        if request.get("exe") != sys.executable or request.get("version") != sys.version:
            return (f"the worker runs {request.get('exe')}, the agent's warm process {sys.executable}: "
                    "start torchrun with the workers' interpreter")
        return ""

    def _import(self, names) -> None:
        for name in names:
            if name in sys.modules or name in self.failed:
                continue
            try:
                importlib.import_module(name)
            except Exception as exc:  # the child imports it again and reports the error itself, as a cold start would
                self.failed.add(name)
                print(f"elastic-mnist warm start: could not preload {name}: {exc}", file=sys.stderr, flush=True)

    def _reap(self, pidfd: int) -> None:
        pid, conn = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        _, status = os.waitpid(pid, 0)
        _wire.send_line(conn, {"exit": os.waitstatus_to_exitcode(status)})
        _close([pidfd], conn)

    def _close_in_child(self, keep: socket.socket) -> None:
        """A child keeps only its own connection: one holding another's would hide that stand-in's end."""
        self.selector.close()
        self.listener.close()
        os.close(self.agent)
        for pidfd, (_, conn) in self.children.items():
            _close([pidfd], conn)
        self.children.clear()


def _cuda_refusal() -> str:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised in the warm process (a forked child could not use it)"
    return ""


def _gone(conn: socket.socket) -> bool:
    """The stand-in gave up meanwhile (it starts cold then): forking for it would run the worker twice."""
    readable, _, _ = select.select([conn], [], [], 0)  # not conn.recv: with a timeout set it would wait
    if not readable:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _close(fds: list[int], conn: socket.socket) -> None:
    for fd in fds:
        os.close(fd)
    conn.close()


def start_for_workers(environ=os.environ, wait_warm: bool = True) -> subprocess.Popen | None:
    """In the torchrun agent: start its warm process and point the workers it starts at it, once it
    listens; with `wait_warm`, once it has imported torch too (at most WARM_TIMEOUT_S). It dies with the
    agent (parent-death signal, and it watches the agent's pidfd). None where it cannot start: workers
    start cold."""
    if not hasattr(os, "pidfd_open"):
        return None
    address = _wire.new_address()
    ready_r, ready_w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "elastic_mnist.warm.server", "--agent", str(os.getpid()),
                                 "--address", address, "--ready-fd", str(ready_w)], stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=procs.die_with_parent_preexec(), pass_fds=[ready_w])
        os.close(ready_w)
        listening = _read_mark(ready_r, READY_TIMEOUT_S) == LISTENING
        warm = listening and (not wait_warm or _read_mark(ready_r, WARM_TIMEOUT_S) == WARM)
    finally:
        os.close(ready_r)
    atexit.register(_stop, proc)
    if not listening:
        print("elastic-mnist warm start: the warm process did not start; workers start cold", file=sys.stderr)
        return None
    if not warm:  # still importing (a slow disk): the first workers wait for it, later ones start warm
        print(f"elastic-mnist warm start: torch not imported after {WARM_TIMEOUT_S:.0f} s; going on",
              file=sys.stderr)
    environ[_wire.ADDRESS_ENV] = address
    return proc


def _read_mark(fd: int, timeout_s: float) -> bytes:
    readable, _, _ = select.select([fd], [], [], timeout_s)
    return os.read(fd, 1) if readable else b""


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m elastic_mnist.warm.server")
    parser.add_argument("--agent", type=int, required=True, help="the torchrun agent's pid: end when it ends")
    parser.add_argument("--address", required=True, help="the abstract socket to listen on (@NAME)")
    parser.add_argument("--ready-fd", type=int, default=-1, help="write 1 to this fd once listening, 2 once warm")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the agent's to handle; we end with it
    try:
        server = Server(args.address, args.agent)
    except ProcessLookupError:
        return  # the agent is gone already
    if args.ready_fd >= 0:
        os.write(args.ready_fd, LISTENING)
    server._import(BASE_PRELOAD)
    if args.ready_fd >= 0:
        try:
            os.write(args.ready_fd, WARM)
        except BrokenPipeError:
            pass  # the agent did not wait for this one (a job starting from no node)
        os.close(args.ready_fd)
    job = server.serve()
    if job is not None:
        job.run()  # in the forked child only: the worker, from its own __main__


if __name__ == "__main__":
    main()
