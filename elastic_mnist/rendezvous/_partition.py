"""Partial partitions: when members of a round cannot reach each other, the round goes on with one side.

    torchrun --rdzv-backend=etcd-v3 ...    # on with peer_probe (the default); peer_probe=0 turns it off

A probe that times out (silence, not a refusal: _liveness.py) proves nothing about a peer's life, but it
does prove that this host cannot reach it. Every agent publishes with its beacon the peers it cannot reach
(silent twice, the second time for CONFIRM_S), and it can only publish while it reaches etcd. From those
reports, which every agent reads alike, `losing_side` keeps the largest group of nodes that all reach each
other and names the rest. A tie goes to the group with the most members of the last completed round (the
nodes training now), then to the lowest node names: reports are not read at one instant, so when a cut
heals, an agent may still read a peer's old report about the returning node while its own is already
clear. Seen that way, the returning node and either member of the running pair tie; without the
incumbents' preference the names could give the returning node the win, each of the pair would hide the
other, and the returning node would form a round of its own. RoundView hides the rest from
what torch sees on the winning side; a node on the losing side holds its join (PromptOpExecutor) until
it reaches the winning side again, without starting workers or spending restarts, then joins as a new
node would. A node whose peers' reports name it goes on being hidden until they probe it again, which
they do as soon as it waits to join.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

CONFIRM_S = 1.0  # a reachable kernel answers a SYN in well under a millisecond, even on a loaded host
REPORT = "unreach="  # the field of a beacon's value that lists the peers its agent cannot reach
EXACT_UP_TO = 12  # nodes; beyond, the side is chosen greedily (incumbents, then lowest names first)


def encode(unreachable: Iterable[str]) -> str:
    """The report field appended to a beacon's value ('' when every peer is reachable)."""
    names = sorted(unreachable)
    return f" {REPORT}{','.join(names)}" if names else ""


def decode(field: str) -> frozenset[str]:
    """The names in a report field (anything else: no report)."""
    field = field.strip()
    return frozenset(n for n in field[len(REPORT):].split(",") if n) if field.startswith(REPORT) else frozenset()


def losing_side(nodes: Iterable[str], reports: Mapping[str, Iterable[str]],
                incumbents: Iterable[str] = ()) -> set[str]:
    """The nodes to leave out of the round: all but the largest group whose members all reach each other;
    of groups as large, the one with the most `incumbents` (the last completed round's members), then the
    lowest names. A pair is cut when either end reports the other (one-way loss breaks TCP both ways)."""
    ordered = sorted(set(nodes))
    cut = {frozenset((a, b)) for a in ordered for b in reports.get(a, ()) if b in ordered and b != a}
    if not cut:
        return set()
    return set(ordered) - set(_largest_side(ordered, cut, frozenset(incumbents)))


def _largest_side(ordered: list[str], cut: set[frozenset[str]], incumbents: frozenset[str]) -> tuple[str, ...]:
    def connected(side: tuple[str, ...]) -> bool:
        return all(frozenset(pair) not in cut for pair in itertools.combinations(side, 2))

    if len(ordered) > EXACT_UP_TO:
        side: tuple[str, ...] = ()
        for name in sorted(ordered, key=lambda n: (n not in incumbents, n)):
            if connected((*side, name)):
                side = (*side, name)
        return side
    for size in range(len(ordered), 0, -1):
        # combinations of a sorted list come in lexicographic order, and max() keeps the first of equals:
        # the connected side of this size with the most incumbents, then the lowest names
        sides = [side for side in itertools.combinations(ordered, size) if connected(side)]
        if sides:
            return max(sides, key=lambda side: len(incumbents.intersection(side)))
    return ()
