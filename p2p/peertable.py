"""One entry of the live peer table: a peer's heartbeat, as it is validated.

Every peer announces itself in the DHT (``Swarm.announce``, one subkey per peer id of the
run's key) with the fields below; whatever another peer stored there is checked here
before it counts (``parse_peer_record``: a ValueError with a short reason, which the
swarm counts as a rejected message). ``p2p/records.py`` makes sure an entry is its
owner's; this module says what a well-formed one holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.fingerprint import parse_parts

STATES = ("joining", "training", "ready", "averaging", "checking", "stopped")
# The most peer-table entries one lookup keeps (each signed by its owner; a closed swarm's by
# admitted peers only).
MAX_TABLE_ENTRIES = 4096


@dataclass(slots=True, frozen=True)
class PeerRecord:
    """One validated entry of the live peer table."""

    peer_id: str
    state: str
    round: int
    params_hash: str
    inner_step: int
    loss: float | None
    maddrs: tuple[str, ...]
    round_tokens: int = 0  # tokens trained so far towards its next round
    fingerprint: str = ""  # digest of what the peer trains (trainer/fingerprint.py)
    fingerprint_parts: dict | None = None
    # What the peer says of its last round (``OBSERVED``): shown to operators, never acted on.
    observed: dict[str, float] = field(default_factory=dict)
    # Whether other peers can dial it, as its own check found (p2p/reachability.py); None: unknown.
    # A leader gives parts only to peers that say True (``gathering.owners``).
    reachable: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id,
            "state": self.state,
            "round": self.round,
            "params_hash": self.params_hash,
            "inner_step": self.inner_step,
            "loss": self.loss,
            "round_tokens": self.round_tokens,
            "multiaddrs": list(self.maddrs),
            "reachable": self.reachable,
            **self.observed,
        }


def parse_peer_record(peer_id: Any, value: Any) -> PeerRecord:
    """Validate a heartbeat entry from the DHT; raise ValueError with a short reason."""
    if not isinstance(peer_id, str) or not 20 <= len(peer_id) <= 128:
        raise ValueError("bad_peer_id")
    if not isinstance(value, dict):
        raise ValueError("bad_heartbeat")
    state, rnd, phash = value.get("state"), value.get("round"), value.get("hash")
    step, loss, maddrs = value.get("step", 0), value.get("loss"), value.get("maddrs", [])
    rtok = value.get("rtok", 0)
    fp, fpp = value.get("fp", ""), value.get("fpp")
    if state not in STATES:
        raise ValueError("bad_heartbeat_state")
    if not isinstance(rnd, int) or isinstance(rnd, bool) or not 0 <= rnd < 2**53:
        raise ValueError("bad_heartbeat_round")
    if not isinstance(phash, str) or len(phash) > 128:
        raise ValueError("bad_heartbeat_hash")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError("bad_heartbeat_step")
    if not isinstance(rtok, int) or isinstance(rtok, bool) or not 0 <= rtok < 2**53:
        raise ValueError("bad_heartbeat_round_tokens")
    if loss is not None and not isinstance(loss, (int, float)):
        raise ValueError("bad_heartbeat_loss")
    if not isinstance(maddrs, list) or len(maddrs) > 32 or not all(isinstance(a, str) and len(a) < 512 for a in maddrs):
        raise ValueError("bad_heartbeat_maddrs")
    if not isinstance(fp, str) or len(fp) > 64:
        raise ValueError("bad_heartbeat_fingerprint")
    parts = parse_parts(fpp) if fpp is not None else None
    if fpp is not None and parts is None:
        raise ValueError("bad_heartbeat_fingerprint")
    dial = value.get("dial")
    if dial is not None and not isinstance(dial, bool):
        raise ValueError("bad_heartbeat_dial")
    return PeerRecord(peer_id, state, rnd, phash, step, None if loss is None else float(loss), tuple(maddrs), rtok,
                      fp, parts, parse_observed(value.get("obs", {})), dial)


# Heartbeat field ``obs``: what a peer reports of its last committed round, for `gonka-node top`.
OBSERVED = {"el": "eval_loss", "ar": "allreduce_s", "bw": "allreduce_bytes_per_s", "gw": "gather_wait_s",
            "ab": "aborts", "rj": "rejected"}


def parse_observed(obs: Any) -> dict[str, float]:
    """The known, finite, non-negative numbers of a heartbeat's ``obs`` field, by their long names."""
    if not isinstance(obs, dict) or len(obs) > len(OBSERVED):
        raise ValueError("bad_heartbeat_observed")
    out = {}
    for short, value in obs.items():
        if short not in OBSERVED or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 <= value < 2**53:  # NaN fails the comparison too
            raise ValueError("bad_heartbeat_observed")
        out[OBSERVED[short]] = float(value)
    return out
