"""A node's whole process tree is signalled at once, whatever exits meanwhile.

    python -m pytest -q tests/test_procs.py
"""

from __future__ import annotations

import signal
import subprocess
import time

from elastic_mnist import procs


def test_signal_tree_reaches_every_process_below_the_root():
    # a shell (the agent) with two children (workers), each in the tree only through its parent
    root = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    try:
        def three():
            tree = procs.descendants(root.pid)
            return tree if len(tree) == 3 else None

        tree = procs.wait_for(three, 30, "the shell and its two children")
        before = time.time()
        assert before <= procs.signal_tree(root.pid, signal.SIGKILL) <= time.time()
        assert root.wait(timeout=10) == -signal.SIGKILL
        procs.wait_for(lambda: not any(procs.alive(pid) for pid in tree), 10, "the children gone")
        procs.signal_tree(root.pid, signal.SIGKILL)  # nothing left below it: no error
    finally:
        if root.poll() is None:
            root.kill()
            root.wait()


def test_a_best_effort_console_survives_closed_pipes_to_the_interpreter_exit():
    """stdout and stderr both pipes without a reader: every write, and the flush at exit, succeed."""
    import os
    import sys

    code = ("from elastic_mnist import procs; procs.best_effort_console(); import sys; print('x' * 100000); "
            "sys.stderr.write('y'); print('z', end=''); sys.exit(7)")
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        run = subprocess.run([sys.executable, "-c", code], stdout=write_end, stderr=write_end, timeout=60,
                             env=procs.child_env())
    finally:
        os.close(write_end)
    assert run.returncode == 7, "the exit code the program chose: no BrokenPipeError, no failed flush at exit"


def test_one_read_of_proc_gives_each_roots_live_tree_without_zombies():
    """The launcher reads /proc once for all its nodes: each root's tree from that one read is the one a read
    of its own gives, and a child that exited unreaped (a zombie) is in neither."""
    # `sh` forks `true`, then becomes `sleep`, which never reaps it: a zombie under a live root
    zombie_parent = subprocess.Popen(["sh", "-c", "true & exec sleep 60"], start_new_session=True)
    pair = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        procs.wait_for(lambda: any(procs.proc_state(p) == "Z" for p in procs.children().get(zombie_parent.pid, [])),
                       30, "the unreaped child a zombie")
        procs.wait_for(lambda: len(procs.descendants(pair.pid)) == 2, 30, "the shell and its child")
        tree = procs.children()
        assert procs.descendants(zombie_parent.pid, tree) == procs.descendants(zombie_parent.pid) == [
            zombie_parent.pid]
        assert sorted(procs.descendants(pair.pid, tree)) == sorted(procs.descendants(pair.pid))
        assert len(procs.descendants(pair.pid, tree)) == 2
    finally:
        for proc in (zombie_parent, pair):
            procs.signal_tree(proc.pid, signal.SIGKILL)
            proc.wait()

