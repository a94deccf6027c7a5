"""The ledger: one entry per committed round saying who contributed what, and what it costs a member.

At commit every member of a round builds the same entry (``build_entry``) from what
the round itself agreed on: each member's claimed tokens (as it declared them to
the owners), the tokens the average counted (capped, times its standing), and its
scores (p2p/scores.py: norm, agreement, copy, work per token). Its *verdict* is a
set of flags (``verdicts``) and its *credit* the tokens counted when it has none,
0 otherwise. The entry's digest is part of what the members sign
(``CommitCertificate.message``), so the commit certificate, signed by more than
half of the members, covers it, and the entry travels, is stored and is verified
with the certificate (p2p/commits.py; the file format for other systems:
docs/ledger.md).

*Standing* (``Standing``): a member flagged in one of the last STANDING_ROUNDS
entries (by its row's flags, or by every checker of a check those entries carry,
p2p/checks.py) counts DOWN_WEIGHT of its tokens in the average; flagged for two
rounds, it is left out of groups until they age out. It is a pure function of the entries, which every
peer at the same state holds (a joiner gets them with the certificate chain), so
every member of a group computes the same weights (the leader's proposal carries a
digest of them: ``Standing.digest``).

Flags (a group of fewer than MIN_JUDGED members judges nobody: with two, either
could be the liar):
- ``zero``: nothing sent (a norm per token below ZERO_WORK of the median's);
- ``idle``: far less change than its tokens claim (below IDLE_WORK of the median's):
  one inner step and a claim of H;
- ``against``: an agreement at or below 0, or below AGAINST_FRACTION of the median
  member's: noise, or an update pointing away from the others';
- ``copy``: a cosine of COPY_COSINE or more with another member's input (both flagged:
  from the round alone nobody can tell the original).
"""

from __future__ import annotations

import base64
import hashlib
import math
import statistics
from dataclasses import dataclass
from typing import Callable, Iterable

import msgpack

from p2p.checks import MAX_CHECKS_PER_ENTRY, CheckRecord, checkers_by_entry, failed, judged
from p2p.scores import Score

ENTRY_VERSION = 1
MIN_JUDGED = 3
ZERO_WORK = 1e-3
IDLE_WORK = 0.1
AGAINST_FRACTION = 0.25
COPY_COSINE = 0.99
STANDING_ROUNDS = 16
DOWN_WEIGHT = 0.25
FLAGS = ("zero", "idle", "against", "copy")
MAX_ROWS = 1024
_FIELDS = ("peer", "claimed", "counted", "factor", "norm", "agreement", "copy", "partner", "work", "flags", "credit")


@dataclass(frozen=True, slots=True)
class Row:
    """One member's line of a round's entry."""

    peer: str
    claimed: float  # tokens it declared to the owners
    counted: float  # tokens the average counted: capped (p2p/aggregate.py), times ``factor``
    factor: float  # its standing when the round began (1, DOWN_WEIGHT)
    norm: float
    agreement: float
    copy: float
    partner: int  # member index of its closest other input (-1: none)
    work: float
    flags: tuple[str, ...]
    credit: float  # ``counted`` if not flagged, else 0

    def to_list(self) -> list:
        return [self.peer, self.claimed, self.counted, self.factor, self.norm, self.agreement, self.copy,
                self.partner, self.work, list(self.flags), self.credit]

    @classmethod
    def from_list(cls, value) -> "Row":
        if not (isinstance(value, list) and len(value) == len(_FIELDS)):
            raise ValueError("bad_entry")
        peer, *numbers, partner, work, flags, credit = value
        floats = [*numbers, work, credit]
        if not (isinstance(peer, str) and 0 < len(peer) <= 128
                and all(isinstance(x, float) and math.isfinite(x) for x in floats)
                and isinstance(partner, int) and not isinstance(partner, bool) and -1 <= partner < MAX_ROWS
                and isinstance(flags, list) and all(f in FLAGS for f in flags) and len(set(flags)) == len(flags)):
            raise ValueError("bad_entry")
        return cls(peer, *numbers, partner, work, tuple(flags), credit)

    def to_json(self) -> dict:
        return dict(zip(_FIELDS, self.to_list()))


@dataclass(frozen=True, slots=True)
class Entry:
    """A committed round's ledger entry: one row per member, in member order; the checks of
    earlier rounds its leader proposed (p2p/checks.py); the members that owned a part (empty:
    all), which the checks' beacon chooses among."""

    round: int  # the round the commit produced (as its certificate's)
    rows: tuple[Row, ...]
    checks: tuple[CheckRecord, ...] = ()
    owners: tuple[str, ...] = ()

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(r.peer for r in self.rows)

    def to_list(self) -> list:
        out = [ENTRY_VERSION, self.round, [r.to_list() for r in self.rows]]
        if self.checks or self.owners:
            out += [[c.to_wire() for c in self.checks], list(self.owners)]
        return out

    def pack(self) -> bytes:
        return msgpack.packb(self.to_list(), use_bin_type=True)

    def digest(self) -> bytes:
        """What the members' signatures cover (``CommitCertificate.message``)."""
        return hashlib.sha256(self.pack()).digest()

    @classmethod
    def from_list(cls, value) -> "Entry":
        """Parse an entry from a peer or a file (check records verified); ValueError("bad_entry")
        if malformed."""
        if not (isinstance(value, list) and len(value) in (3, 5) and value[0] == ENTRY_VERSION):
            raise ValueError("bad_entry")
        rnd, rows = value[1], value[2]
        checks, owners = value[3:] if len(value) == 5 else ([], [])
        if not (isinstance(rnd, int) and not isinstance(rnd, bool) and 0 < rnd < 2**53
                and isinstance(rows, list) and 0 < len(rows) <= MAX_ROWS
                and isinstance(checks, list) and len(checks) <= MAX_CHECKS_PER_ENTRY
                and isinstance(owners, list) and all(isinstance(o, str) for o in owners)):
            raise ValueError("bad_entry")
        try:
            records = tuple(CheckRecord.from_wire(c) for c in checks)
        except ValueError:
            raise ValueError("bad_entry") from None
        entry = cls(rnd, tuple(Row.from_list(r) for r in rows), records, tuple(owners))
        peers = entry.members
        if (list(peers) != sorted(set(peers)) or any(r.partner >= len(rows) for r in entry.rows)
                or list(owners) != sorted(set(owners)) or not set(owners) <= set(peers)
                or any(r.round >= rnd for r in records)):
            raise ValueError("bad_entry")
        return entry

    def to_json(self) -> dict:
        out = {"version": ENTRY_VERSION, "round": self.round, "rows": [r.to_json() for r in self.rows]}
        if self.checks or self.owners:
            out["checks"] = [{"scope": c.scope, "round": c.round, "sampled": c.sampled, "checker": c.checker,
                              "gains": list(c.gains), "public_key": base64.b64encode(c.public_key).decode(),
                              "signature": base64.b64encode(c.signature).decode()} for c in self.checks]
            out["owners"] = list(self.owners)
        return out

    @classmethod
    def from_json(cls, value) -> "Entry":
        if not (isinstance(value, dict) and isinstance(value.get("rows"), list)):
            raise ValueError("bad_entry")
        rows = [[r.get(f) for f in _FIELDS] if isinstance(r, dict) else None for r in value["rows"]]
        wire = [value.get("version"), value.get("round"), rows]
        if "checks" in value or "owners" in value:
            checks = value.get("checks")
            if not isinstance(checks, list) or not all(isinstance(c, dict) for c in checks):
                raise ValueError("bad_entry")
            try:
                wire += [[[c.get("scope"), c.get("round"), c.get("sampled"), c.get("checker"), c.get("gains"),
                           base64.b64decode(c.get("public_key", ""), validate=True),
                           base64.b64decode(c.get("signature", ""), validate=True)] for c in checks],
                         value.get("owners")]
            except (ValueError, TypeError):
                raise ValueError("bad_entry") from None
        return cls.from_list(wire)


def verdicts(scores: list[Score]) -> list[tuple[str, ...]]:
    """Each member's flags from the round's scores (see the module docstring)."""
    if len(scores) < MIN_JUDGED:
        return [()] * len(scores)
    typical = statistics.median(s.agreement for s in scores)
    out = []
    for s in scores:
        flags = []
        if s.work < ZERO_WORK:
            flags.append("zero")
        elif s.work < IDLE_WORK:
            flags.append("idle")
        if s.norm > 0 and (s.agreement <= 0 or s.agreement < AGAINST_FRACTION * typical):
            flags.append("against")
        if s.copy >= COPY_COSINE:
            flags.append("copy")
        out.append(tuple(flags))
    return out


def build_entry(round: int, members: list[str], claimed: list[float], counted: list[float],
                factors: list[float], scores: list[Score], checks: Iterable[CheckRecord] = (),
                owners: Iterable[str] = ()) -> Entry:
    """The entry of a committed round, the same on every member."""
    rows = []
    for peer, c, n, f, s, flags in zip(members, claimed, counted, factors, scores, verdicts(scores)):
        rows.append(Row(peer, float(c), float(n), float(f), s.norm, s.agreement, s.copy, s.partner, s.work,
                        flags, 0.0 if flags else float(n)))
    return Entry(round, tuple(rows), tuple(checks), tuple(owners))


class Standing:
    """What the last entries say of each peer: the share of its tokens the next average counts."""

    def __init__(self, entries: Iterable[Entry], lookup: Callable[[int], Entry | None] = lambda round: None) -> None:
        """``entries``: the last STANDING_ROUNDS (or fewer) entries before the round to weigh;
        ``lookup(round)``: the entry of a round a check in them is about, if known (whose
        beacon chose its checkers)."""
        entries = list(entries)
        rounds: dict[str, set[int]] = {}
        for entry in entries:
            for row in entry.rows:
                if row.flags:
                    rounds.setdefault(row.peer, set()).add(entry.round)

        # A failed check counts once a second one confirms it: a verdict on 32 windows can miss
        # an honest host (a slow one in its warmup, say) where a row's flags do not.
        checked_out: dict[str, set[int]] = {}
        for sampled, rnd in failed([c for e in entries for c in e.checks], checkers_by_entry(lookup)):
            checked_out.setdefault(sampled, set()).add(rnd)
        for peer, failures in checked_out.items():
            if len(failures) >= 2:
                rounds.setdefault(peer, set()).update(failures)
        self.flagged = {peer: len(r) for peer, r in rounds.items()}

    def factor(self, peer: str) -> float:
        """1, DOWN_WEIGHT after one flagged round in the window, 0 (left out) after two."""
        n = self.flagged.get(peer, 0)
        return 1.0 if n == 0 else DOWN_WEIGHT if n == 1 else 0.0

    def left_out(self) -> set[str]:
        return {p for p in self.flagged if self.factor(p) == 0.0}

    def factors(self, members: list[str]) -> list[float]:
        return [self.factor(p) for p in members]

    def digest(self, members: list[str]) -> bytes:
        """8 bytes naming ``factors(members)``: a leader's proposal carries it, and a member whose
        own entries give other weights refuses the group rather than average differently."""
        return hashlib.sha256(msgpack.packb([members, self.factors(members)])).digest()[:8]


def passed(records: Iterable[CheckRecord], checkers: Callable[[int, str], tuple[str, ...] | None]
           ) -> set[tuple[str, int]]:
    """(sampled, round) of every check that every assigned checker judged and none flagged."""
    clean: dict[tuple[str, int], set[str]] = {}
    spoiled = set()
    for r in records:
        key = (r.sampled, r.round)
        if r.flags or not judged(r.gains):
            spoiled.add(key)
        else:
            clean.setdefault(key, set()).add(r.checker)
    return {(s, rnd) for (s, rnd), by in clean.items()
            if (s, rnd) not in spoiled and (assigned := checkers(rnd, s)) and set(assigned) <= by}


def revoked(records: Iterable[CheckRecord], checkers: Callable[[int, str], tuple[str, ...] | None],
            rounds: dict[str, Iterable[int]]) -> set[tuple[str, int]]:
    """(peer, round) whose credit failed checks take back. A failed round always; and once a
    second failed check within STANDING_ROUNDS confirms it (two leave a member out), every
    round of ``rounds[peer]`` (the rounds it was a member of) since its last passed check before
    it: a run's first rounds, when checks abstain, earn their credit once a later check passes,
    not before a liar is caught. One failure of an honest host (a slow one in its warmup, say)
    costs it that round only."""
    records = list(records)
    bad, good = failed(records, checkers), passed(records, checkers)
    out = set()
    for peer, mine in rounds.items():
        failures = sorted(r for p, r in bad if p == peer)
        for rnd in failures:
            confirmed = any(other != rnd and abs(other - rnd) < STANDING_ROUNDS for other in failures)
            since = max((r for p, r in good if p == peer and r < rnd), default=0) if confirmed else rnd - 1
            out.update((peer, r) for r in mine if since < r <= rnd)
    return out


def revoked_in(entries: Iterable[Entry]) -> set[tuple[str, int]]:
    """``revoked`` of the checks the ``entries`` carry, against those entries' members and the
    checkers their beacons named."""
    entries = list(entries)
    member_of: dict[str, list[int]] = {}
    for e in entries:
        for row in e.rows:
            member_of.setdefault(row.peer, []).append(e.round)
    return revoked([c for e in entries for c in e.checks], checkers_by_entry({e.round: e for e in entries}.get),
                   member_of)
