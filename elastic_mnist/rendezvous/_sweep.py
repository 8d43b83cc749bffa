"""A finished round's keys leave etcd: a run of weeks forms hundreds of rounds, and each leaves what torch's
agent wrote in the job's store for it (every rank's role and assigned rank, rank 0's address: about 3 keys
a node), which nothing reads once the round is over.

    torchrun --rdzv-backend=etcd-v3 ...    # applied by create_rdzv_handler; nothing to configure

Once a round has formed, the node that got rank 0 in it deletes the keys of the rounds KEEP_ROUNDS and more
behind it, WINDOW rounds back: a round whose rank 0 died before it swept is covered by the next ones. The
round before the current one stays: its late members may still read it on their way out. The same node also
removes the beacon keys of nodes that left no heartbeat in the job's state for two rounds (a vanished host's).
"""

from __future__ import annotations

import sys
from dataclasses import replace

from elastic_mnist.compat.private import round_store_prefix
from elastic_mnist.etcd.client import EtcdV3Error
from elastic_mnist.rendezvous._prompt import RoundView
from elastic_mnist.rendezvous.policy import AgentPolicy, Layer, Methods
from elastic_mnist.rendezvous.store import EtcdV3Store

KEEP_ROUNDS = 2  # the current round and the one before it stay
WINDOW = 4


def rounds_to_sweep(current: int) -> range:
    return range(max(0, current - KEEP_ROUNDS - WINDOW + 1), max(0, current - KEEP_ROUNDS + 1))


def sweep_finished_rounds(view: RoundView, store: EtcdV3Store, run_id: str) -> Layer:
    """The policy's sweep layer: next_rendezvous."""
    def layer(inner: Methods, policy: AgentPolicy) -> Methods:
        def next_rendezvous():
            info = inner.next_rendezvous()
            read = view.read
            if read is not None and info.rank == 0:
                sweep(store, run_id, read[0])
                sweep_beacons(view, read[0])
            return info

        return replace(inner, next_rendezvous=next_rendezvous)
    return layer


def sweep(store: EtcdV3Store, run_id: str, current: int) -> None:
    """Best effort: a failed delete is left for the next round's rank 0."""
    try:
        for old in rounds_to_sweep(current):
            store.delete_under(round_store_prefix(run_id, old))
    except EtcdV3Error as exc:
        print(f"elastic-mnist etcd-v3: warning: old rounds' keys not deleted this time ({exc})", file=sys.stderr)


def sweep_beacons(view: RoundView, current: int) -> None:
    """Best effort, as `sweep`: what is left stays for the next round's rank 0 (or its lease)."""
    if view.liveness is None:
        return
    try:
        view.liveness.sweep_absent(view.beating, current, view.window.total_seconds())
    except (EtcdV3Error, OSError) as exc:
        print(f"elastic-mnist etcd-v3: warning: departed nodes' beacons not deleted this time ({exc})",
              file=sys.stderr)
