"""Who may commit a round: pure decisions over the peer table, tested without a network.

A round commits only with a strict majority of the peers that are live at
that round (this peer included), and never with fewer than ``min_peers``
members. Two disjoint groups can then never both commit the same round: each
would need more than half of the same live peers. A peer that is merely
*suspected* (it did not answer once, it refused a group) still counts as live
while its heartbeats keep coming: suspicion keeps it out of the next attempt,
but must not let the others commit as a minority. A dead peer stops counting
when its heartbeat expires (three heartbeat intervals).

The network code (``rounds.py``) gathers the inputs and carries the decision out.
"""

from __future__ import annotations

from typing import Iterable

# States of a peer that trains at a round (it will be ready for it, or is averaging it).
LIVE_STATES = frozenset({"training", "ready", "averaging"})


def live_at(peers: dict, round: int, me: str) -> set[str]:
    """The peers live at ``round``: announcing that round in a live state, and this peer."""
    return {p for p, r in peers.items() if r.round == round and r.state in LIVE_STATES} | {me}


def quorum(live: int, min_peers: int = 1) -> int:
    """Members a round needs: a strict majority of ``live`` peers, at least ``min_peers``."""
    return max(min_peers, live // 2 + 1)


def can_start(ready: Iterable[str], live: set[str], min_peers: int) -> tuple[bool, str]:
    """Whether a group of the ``ready`` peers may start the round, and why not. A ready peer
    is live (it said so, perhaps directly, before the table showed it)."""
    members = set(ready)
    live = live | members
    needed = quorum(len(live), min_peers)
    if len(members) < needed:
        return False, f"{len(members)} of {len(live)} live peers ready, {needed} needed"
    return True, ""


def accept_group(members: list[str], live: set[str], min_peers: int) -> tuple[bool, str]:
    """A member's own check of a leader's proposal: a strict majority of the peers *it* sees live.

    A leader whose table is stale or who lies cannot pull this peer into a minority group."""
    needed = quorum(len(live | set(members)), min_peers)
    if len(members) < needed:
        return False, "no_quorum"
    return True, ""


def follow(peers: dict, me: str) -> tuple[int, str, list[str]] | None:
    """The state the swarm agrees on, as (round, params_hash, holders): the one announced by a
    strict majority of the *other* live peers that hold a state; None if no state has one.

    Never one peer's word where others disagree or stay silent about it: a hostile peer (or a
    minority of them) announcing a newer round or another hash is outvoted by the rest. In a
    swarm of two, the majority of the others is the other peer. The state offered must still
    come with a certificate chain (``commits.verify_chain``) before anyone loads it."""
    holders = {p: (r.round, r.params_hash) for p, r in peers.items()
               if p != me and r.state in LIVE_STATES and r.params_hash}
    counts: dict[tuple[int, str], int] = {}
    for state in holders.values():
        counts[state] = counts.get(state, 0) + 1
    for (rnd, params_hash), n in counts.items():
        if 2 * n > len(holders):
            return rnd, params_hash, sorted(p for p, s in holders.items() if s == (rnd, params_hash))
    return None
