"""After every rendezvous: agree which rank holds the newest valid state, and send it to those that lack it.

    torchrun ... -m elastic_mnist.train --checkpoint-storage local --checkpoint-dir /local/ckpt

Each rank offers its best candidate: the state its process holds in memory from the round before (a worker
kept across rounds), or the newest verified checkpoint in its --checkpoint-dir, or a newer in-memory snapshot
(--snapshot-dir, e.g. /dev/shm, which outlives the worker process). The ranks all-gather (step, identity):
a file's checksum, or the lineage of a state in memory (the round that agreed on it: every survivor of that
round holds the same bytes). The lowest rank holding the newest step (memory first) broadcasts its bytes to
every rank that does not hold the same; receivers verify the checksum. With shared storage, or survivors of
one round, nothing is sent, and a state held in memory is never decoded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic_mnist.contract.errors import NodeLocalError, PeerNodeLocalError, UserError
from elastic_mnist.distributed import group_device, wait
from elastic_mnist.state import format as checkpoint

MEMORY = "memory"  # the source of a state held in this process's memory


@dataclass
class Candidate:
    step: int
    blob: bytes
    source: str
    """The file it came from, for the resume line (MEMORY for the state this process holds)."""
    state: dict | None = None
    """The decoded state when this rank verified it itself (decoded once); None for bytes a peer sent."""
    lineage: str = ""
    """A state held in memory: the round that agreed on it (its blob is made only if a peer needs it)."""
    encode: Callable[[], bytes] | None = None

    @property
    def ident(self) -> str:
        return f"{MEMORY}:{self.lineage}" if self.source == MEMORY else checkpoint.digest_of(self.blob)

    def bytes_to_send(self) -> bytes:
        return self.blob or (self.encode() if self.encode is not None else b"")


def held(step: int, lineage: str, encode: Callable[[], bytes]) -> Candidate:
    """The state this process's objects hold, agreed at `step` by the round `lineage`."""
    return Candidate(step, b"", MEMORY, lineage=lineage, encode=encode)


def newest_valid(directory: str, warn: Callable[[str], None], origin: dict | None = None,
                 key: bytes | None = None, above: int = -1) -> Candidate | None:
    """The newest file in `directory` named after a step past `above` that verifies (and, for snapshots,
    belongs to this job)."""
    for step, path, blob, state in checkpoint.iter_valid(directory, warn, key, above):
        if origin is not None and state.get("origin") != origin:
            warn(f"warning: ignoring snapshot {path}: it belongs to another job ({state.get('origin')})")
            continue
        return Candidate(step, blob, path, state)
    return None


def best_local(checkpoint_dir: str, snapshot_dir: str, origin: dict, warn, key: bytes | None = None,
               memory: Candidate | None = None) -> Candidate | None:
    """The newest state this rank has: `memory`, unless a file is named newer (only such files are read)."""
    floor = memory.step if memory is not None else -1
    files = [c for c in (newest_valid(checkpoint_dir, warn, key=key, above=floor),
                         newest_valid(snapshot_dir, warn, origin, key, above=floor) if snapshot_dir else None)
             if c is not None]
    return max(files, key=lambda c: c.step, default=memory)


def agree_errors(error: str | None, world_size: int, node_local: bool = False) -> None:
    """Every rank raises if any rank found bad input; nobody is left in a collective. An error every node would
    meet (a flag, the data, another model's checkpoint) is raised by every rank alike: the job ends. One that is
    only its node's (`node_local`: its own checkpoint dir) ends that node: the ranks that found it raise their
    NodeLocalError, every other rank PeerNodeLocalError (the round ends, the next forms without that node)."""
    mine = [error, bool(node_local)]
    found = [mine] if world_size == 1 else [json.loads(b) for b in all_gather_bytes(json.dumps(mine).encode())]
    job_wide = next((e for e, local in found if e and not local), None)
    if job_wide:
        raise UserError(job_wide)
    if error:
        raise NodeLocalError(error)
    where = [r for r, (e, _) in enumerate(found) if e]
    if where:
        raise PeerNodeLocalError(f"rank {where[0]} cannot go on on its node ({found[where[0]][0]}); this round ends "
                                 "and the next forms without that node")


def agree_on_state(mine: Candidate | None, rank: int, world_size: int,
                   generation: str = "") -> tuple[Candidate | None, int, list[int], str]:
    """(the newest state, the rank that had it, the ranks it was sent to, rank 0's `generation`).
    The generation token (fence.py) rides in the same all-gather: every rank learns it at no extra cost."""
    offer = [mine.step, mine.ident, generation, int(mine.source == MEMORY)] if mine else [-1, "", generation, 0]
    offers = [offer]
    if world_size > 1:  # a lone process has nobody to agree with (and may have no process group)
        offers = [json.loads(b) for b in all_gather_bytes(json.dumps(offer).encode())]
    best, token = max((o[0], o[3]) for o in offers), str(offers[0][2])
    if best[0] < 0:
        return None, -1, [], token
    owner = min(r for r, o in enumerate(offers) if (o[0], o[3]) == best)
    needy = [r for r, offer in enumerate(offers) if offer[:2] != offers[owner][:2]]
    if not needy:
        return mine, owner, [], token
    blob = broadcast_bytes(mine.bytes_to_send() if rank == owner else b"", owner)
    if rank in needy:
        mine = Candidate(best[0], blob, f"rank {owner} (sent over the process group)")
    return mine, owner, needy, token


# Bytes, not pickled objects, travel between ranks: what a peer sends is parsed as JSON or verified as a
# checkpoint (checksum, weights_only), so nothing a peer sends can run code here. Nor can the size it
# announces make a rank allocate without bound: an all-gathered message (an offer, an error line) is at most
# MESSAGE_CAP, a broadcast state at most what this rank could read from its own disk (format.read_limit).
MESSAGE_CAP = 1 << 20


class TransferRefused(RuntimeError):
    """A peer announced more bytes than this rank accepts; every rank of the group raises it together."""


def all_gather_bytes(data: bytes, group=None) -> list[bytes]:
    """Every rank's bytes, in rank order of `group` (or the default group)."""
    dev, world = group_device(), dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    wait(dist.all_gather(sizes, size, group=group, async_op=True))
    longest = max(int(s) for s in sizes)
    if longest > MESSAGE_CAP or min(int(s) for s in sizes) < 0:  # every rank sees the same sizes: all raise
        raise TransferRefused(f"a peer announced a {longest:,}-byte message during the state agreement, over the "
                              f"cap of {MESSAGE_CAP:,}: not this package's protocol; check what runs on every node")
    mine = torch.zeros(longest, dtype=torch.uint8, device=dev)
    if data:  # torch cannot view an empty buffer
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    wait(dist.all_gather(gathered, mine, group=group, async_op=True))
    return [t[:int(n)].cpu().numpy().tobytes() for t, n in zip(gathered, sizes)]


def broadcast_bytes(data: bytes, src: int, group=None) -> bytes:
    """`src`'s bytes (`src` a rank of `group`, or of the default group) on every rank."""
    dev, me = group_device(), dist.get_rank(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    wait(dist.broadcast(size, group=group, group_src=src, async_op=True))
    # The cap depends on each rank's free memory: agree on refusing, so no rank waits in the next broadcast.
    limit = checkpoint.read_limit() if me != src else int(size)
    refused = torch.tensor([int(not 0 <= int(size) <= limit)], dtype=torch.int64, device=dev)
    wait(dist.all_reduce(refused, op=dist.ReduceOp.MAX, group=group, async_op=True))
    if int(refused):
        raise TransferRefused(f"rank {src} announced a {int(size):,}-byte state, more than a rank of this group can "
                              "hold (half its available memory): free memory on the nodes, or fewer per node")
    buf = torch.zeros(int(size), dtype=torch.uint8, device=dev)
    if me == src and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    wait(dist.broadcast(buf, group=group, group_src=src, async_op=True))
    return buf.cpu().numpy().tobytes()


def keep_durable_copy(candidate: Candidate, directory: str) -> bool:
    """A state that came from a peer or from memory also goes to this rank's checkpoint dir."""
    path = checkpoint.path_for(directory, candidate.step)
    if os.path.abspath(candidate.source) == os.path.abspath(path):
        return False
    return checkpoint.write_durable(path, candidate.blob)
