"""Who may commit a round, and which state to follow: pure decisions over the peer table.

**Quorum.** A round commits only with a strict majority of the live peers
(this peer included; live = heartbeating and not joining, at whatever round
they announce), and never with fewer than ``min_peers`` members. Two disjoint
groups can then never both commit: each would need more than half of the
same live peers — also not two groups at different round numbers, so the
swarm cannot split into two lineages either. A peer that is merely
*suspected* (it did not answer once, it refused a group) or quarantined still
counts as live while its heartbeats keep coming: that keeps it out of the
next attempt, but never lets the others commit as a minority. A dead peer
stops counting when its heartbeat expires (three heartbeat intervals).

**Following.** A peer replaces its state only with one that enough others
announce (``follow``), and only with a chain of commit certificates from a
state it trusts (``commits.verify_chain``, checked by the caller before a byte
is downloaded). Strict: the holders are a strict majority of the other live
peers — what a peer in the middle of a round needs before it gives the round
up. Patient (a peer that cannot make progress: joining, or stuck without a
quorum): the holders together with this peer would be a strict majority of
the live peers. One peer's word is never enough where anyone else disagrees
or stays silent; a minority of liars is outvoted, and what they announce has
no certificate chain anyway.

The network code (``rounds.py``, ``node/loop.py``) gathers the inputs and
carries the decision out.
"""

from __future__ import annotations

from typing import Iterable

# States of a peer that holds a state and trains (it will be ready, or is averaging).
LIVE_STATES = frozenset({"training", "ready", "averaging", "checking"})


def live_peers(peers: dict, me: str) -> set[str]:
    """The live peers: announcing a live state (at any round), and this peer."""
    return {p for p, r in peers.items() if r.state in LIVE_STATES} | {me}


def quorum(live: int, min_peers: int = 1) -> int:
    """Members a round needs: a strict majority of ``live`` peers, at least ``min_peers``."""
    return max(min_peers, live // 2 + 1)


def shunned(refusers: Iterable[str], live: set[str], min_peers: int = 1) -> bool:
    """Whether a leader is past leading a round that commits: the live peers that told us they
    refuse its groups (``refusers``; each speaks only for itself, over an authenticated
    stream) leave fewer than a quorum that might not. Joining its groups then only spoils
    attempts, so we refuse them too — on the word of enough peers to block it, never of one."""
    refusing = set(refusers) & live
    return bool(refusing) and len(live - refusing) < quorum(len(live), min_peers)


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


def majority(count: int, others: int, *, patient: bool) -> bool:
    """Whether ``count`` of the ``others`` live peers are a strict majority of them or, when
    ``patient``, would be one of the live peers together with this peer."""
    return 2 * (count + 1) > others + 1 if patient else 2 * count > others


def follow(peers: dict, me: str, mine: tuple[int, str], *, excluded: Iterable[str] = (), patient: bool = False
           ) -> tuple[str, list[tuple[int, str, list[str]]]]:
    """Whether this peer should leave its state ``mine`` = (round, params_hash), and for which.

    Returns (why, candidates): why is "behind" (a majority of the other live peers announce
    newer rounds), "diverged" (a majority holds another state of our round) or "" (stay);
    candidates are the states announced by others at our round or later, other than ours, most
    holders first, then newest — the caller tries them in order, each only with a certificate
    chain. ``excluded`` peers (quarantined) count among the live but vouch for nothing."""
    others = live_peers(peers, me) - {me}
    vouching = sorted(others - set(excluded))
    rnd, params_hash = mine
    ahead = sum(1 for p in vouching if peers[p].round > rnd)
    held: dict[tuple[int, str], list[str]] = {}
    for p in vouching:
        r = peers[p]
        if r.params_hash and r.round >= rnd and (r.round, r.params_hash) != mine:
            held.setdefault((r.round, r.params_hash), []).append(p)
    candidates = sorted(((r, h, holders) for (r, h), holders in held.items()), key=lambda c: (-len(c[2]), -c[0], c[1]))
    if majority(ahead, len(others), patient=patient):
        return "behind", [c for c in candidates if c[0] > rnd]
    same_round = [c for c in candidates if c[0] == rnd]
    if same_round and majority(len(same_round[0][2]), len(others), patient=patient):
        return "diverged", same_round[:1]
    return "", []
