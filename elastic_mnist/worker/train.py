"""The worker entry point: parse the flags, then live (worker/life.py) and exit with its code.

    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=etcd-v3 --rdzv-endpoint=HOST:2379 --rdzv-id=JOB \\
        -m elastic_mnist.train --data-dir DATA --checkpoint-dir CKPT --log-dir RUNS
    python -m elastic_mnist.train --data-dir ../shared/data --epochs 1      # one process, no torchrun

Every start is a resume, and each start-up step is safe to repeat. Exit codes (contract/exit_codes.py): 0 done
(or stopped on our own SIGTERM), 78 a configuration error (one line; under etcd-v3 it ends the whole job), 69 a
problem of this node only (its checkpoint dir, a GPU that fails: worker/devicefault.py; under etcd-v3 it ends this
node, the job goes on), 75 the group stopped for a membership change (torchrun restarts us into the next round), 74
a peer was lost and the save of the last completed step did not finish (worker/failure.py), 70 our agent died and
the group could not agree on a stop in time.
"""

from __future__ import annotations

import signal
import time
from typing import NoReturn

from torch.distributed.elastic.multiprocessing.errors import record

from elastic_mnist import agent_link, distributed, procs
from elastic_mnist.config import parse_args
from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.env import started_at
from elastic_mnist.contract.errors import NodeLocalError, UserError
from elastic_mnist.metrics import process_age_s
from elastic_mnist.runlog import say
from elastic_mnist.worker import life
from elastic_mnist.worker import stop as stop_signals
from elastic_mnist.worker.build import build_trainer
from elastic_mnist.worker.devicefault import device_fault
from elastic_mnist.worker.task import MnistMLP, Task

__all__ = ["build_trainer", "launch", "main"]


@record
def main(argv: list[str] | None = None, task: Task | None = None) -> int:
    """The worker; `task` is what is trained (default: the MNIST MLP). Your own model: examples/."""
    marks = {"process_start": time.time() - process_age_s(), "imports": time.time()}
    procs.best_effort_console()  # a closed stdout (`| head`, an agent's pipe gone) never ends training
    stop = stop_signals.for_process()  # installed before the slow start-up (by -m elastic_mnist.train: before
    # torch loads): a preemption during it is still a graceful stop
    if distributed.read_env().launched and started_at() is None:  # a warm child's parent is
        # the warm process, which set this up at the fork (warm/child.py). If our torchrun agent dies, stop at the
        # next step boundary with the group and save (SIGHUP), rather than die with the steps since the last
        # snapshot (SIGKILL).
        procs.set_parent_death_signal(signal.SIGHUP)
    try:
        config = parse_args(argv)
        stop.set_orphan_grace(config.collective_timeout + 30)  # the agreement, then one blocking save
        return life.live(config, task or MnistMLP(), stop, marks)
    except NodeLocalError as e:
        return _node_local(str(e))
    except UserError as e:
        # A configuration error: no restart can help. Under an etcd-v3 agent it ends the whole job, once
        # (agent_link.py); elsewhere torchrun's retries meet the same line.
        say(f"elastic-mnist train: error: {e}")
        agent_link.report_config_error(str(e))
        return exit_codes.PERMANENT
    except Exception as e:
        fault = device_fault(e)  # a GPU that fails while the process builds (or in a step: worker/life.py)
        if fault is None:
            raise
        return _node_local(fault)


def _node_local(line: str) -> int:
    """This node's own problem (its checkpoint dir, its GPU): another node may train on. Under an etcd-v3 agent it
    ends this node only: the agent leaves the job's rendezvous and exits 69 (agent_link.py), the pod's index fails
    and the start watchdog marks the node (docs/kubernetes.md, "A bad node")."""
    say(f"elastic-mnist train: error: {line}")
    agent_link.report_node_local(line)
    return exit_codes.NODE_LOCAL


def launch(task: Task | None = None) -> NoReturn:
    """Run the worker, then end the process at once. Every writer is closed and flushed by then, and the
    interpreter's own teardown (collecting torch's module graph) costs ~2 s on the path of every
    membership change, where torchrun waits for this process to go. A round that ended for a membership
    change is handed to the agent first (agent_link.end_process): that spends none of its restarts."""
    agent_link.end_process(main(task=task))


if __name__ == "__main__":
    launch()
