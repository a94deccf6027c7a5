"""`gonka-node ledger`: per-peer totals from a node's ledger file, and `ledger verify FILE`.

Both read the file a node writes with every checkpoint (p2p/ledgerfile.py,
docs/ledger.md) and nothing else: no network, no running node. ``ledger`` sums the
entries as they are; ``ledger verify`` checks them (signatures, chain) and is the
one to trust.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from node.errors import EXIT_OK, EXIT_RUNTIME, UsageError, report

FILE_NAME = "ledger.jsonl"  # p2p.ledgerfile.FILE_NAME, kept here so --help imports nothing heavy
FLAGS = ("zero", "idle", "against", "copy")  # p2p.ledger.FLAGS, likewise

USAGE = """\
gonka-node ledger --checkpoint-dir DIR [--rounds A:B] [--json]
       gonka-node ledger verify FILE"""

TOTALS_EPILOG = """\
Exit codes: 0 totals printed; 2 no ledger file in DIR, the file unreadable or
malformed (one line naming it and the line), or a bad --rounds.
"""

VERIFY_HELP = """\
Check a ledger file offline: every line's entry is of its round and members, more
than half of its members' signatures (RSA keys whose hashes are their peer ids)
verify against the certificate's message, which covers the entry's digest; rounds
follow each other by 1, each line's prev is the line before's new, one run scope.
The first line's prev is checked against nothing: at round 1 it is the run's
genesis, which only a peer computing it from the fingerprint can check; a file
that starts later starts from a state this command does not know.

Exit codes: 0 verified; 1 not verified (one line on stderr naming the round and
why); 2 FILE missing, unreadable, or not JSON lines with a ledger line's keys.
"""


def add_parser(commands) -> None:
    p = commands.add_parser(
        "ledger", help="per-peer tokens, credit and flags from a node's ledger file, or verify one",
        usage=USAGE, epilog=TOTALS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"Per-peer totals over the committed rounds of {FILE_NAME} in a node's checkpoint\n"
                    "directory: rounds as member, tokens claimed and counted, credit, credit per\n"
                    "claimed token, rounds flagged (by flag) and the last one. Sums the file as it\n"
                    "is; `gonka-node ledger verify FILE` checks it (docs/ledger.md).")
    p.add_argument("--checkpoint-dir", metavar="DIR", help=f"the node's --checkpoint-dir, which holds {FILE_NAME}")
    p.add_argument("--rounds", metavar="A:B", help="only rounds A to B, both included; either side may be left "
                                                   "out (2:, :10) (default: every round in the file)")
    p.add_argument("--json", action="store_true", help="print the totals as JSON")
    sub = p.add_subparsers(dest="ledger_command", title="verify a file", metavar="verify FILE",
                           help="check a ledger file's signatures and chain, offline (see ledger verify --help)")
    verify = sub.add_parser("verify", usage="gonka-node ledger verify FILE", description=VERIFY_HELP,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    verify.add_argument("file", metavar="FILE", help=f"a ledger file, e.g. DIR/{FILE_NAME}")


def parse_rounds(value: str | None) -> tuple[int | None, int | None]:
    """``--rounds A:B`` as (A, B), None for a side left out; UsageError naming the flag."""
    if value is None:
        return None, None
    first, colon, last = value.partition(":")
    try:
        if not colon:
            raise ValueError
        bounds = tuple(int(s) if s.strip() else None for s in (first, last))
    except ValueError:
        raise UsageError(f"--rounds: expected A:B (round numbers, either side optional), got {value!r}") from None
    if any(b is not None and b < 0 for b in bounds) or (None not in bounds and bounds[0] > bounds[1]):
        raise UsageError(f"--rounds: expected 0 <= A <= B, got {value!r}")
    return bounds


def totals(certs, first: int | None = None, last: int | None = None) -> dict:
    """Per-peer sums over the entries of ``certs`` in rounds ``first``..``last`` (inclusive, None:
    open); sums are exactly rounded (``math.fsum``), so they do not depend on the file's order.

    A round whose check failed (every checker flagged it, in any entry of the file: checks come
    in later rounds' entries) earns no credit, whatever its row said at commit, and neither do
    the peer's rounds since its last passed check once a second failure confirms it (p2p/ledger.py
    ``revoked``)."""
    from p2p.checks import checkers_by_entry, failed
    from p2p.ledger import revoked_in

    entries = {cert.round: cert.entry for cert in certs}
    failing = failed([c for e in entries.values() for c in e.checks], checkers_by_entry(entries.get))
    taken = revoked_in(cert.entry for cert in certs)
    rows: dict[str, list] = {}
    rounds = []
    for cert in certs:
        if (first is not None and cert.round < first) or (last is not None and cert.round > last):
            continue
        rounds.append(cert.round)
        for row in cert.entry.rows:
            rows.setdefault(row.peer, []).append((cert.round, row))
    peers = {}
    for peer, mine in sorted(rows.items()):
        claimed = math.fsum(row.claimed for _, row in mine)
        checked_out = [r for r, _ in mine if (peer, r) in failing]
        credit = math.fsum(row.credit for r, row in mine if (peer, r) not in taken)
        flagged = sorted({r for r, row in mine if row.flags} | set(checked_out))
        peers[peer] = {
            "rounds": len(mine),
            "claimed": claimed,
            "counted": math.fsum(row.counted for _, row in mine),
            "credit": credit,
            "credit_per_claimed": credit / claimed if claimed > 0 else None,
            "flagged": len(flagged),
            "flags": {flag: sum(flag in row.flags for _, row in mine) for flag in FLAGS},
            "failed_checks": len(checked_out),
            "revoked": sum((peer, r) in taken for r, _ in mine),
            "last_flagged": max(flagged) if flagged else None,
        }
    return {"entries": len(rounds), "first_round": min(rounds, default=None),
            "last_round": max(rounds, default=None), "peers": peers}


def _read(path: str, flag: str):
    """The file's certificates, or UsageError naming ``flag`` and the path (and line)."""
    from p2p.ledgerfile import read_ledger

    try:
        return read_ledger(path)
    except OSError as e:
        raise UsageError(f"{flag}: cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise UsageError(f"{flag}: {path} {e}") from None


def _table(result: dict) -> list[str]:
    head = ["PEER", "ROUNDS", "CLAIMED", "COUNTED", "CREDIT", "CREDIT/CLAIMED", "FLAGGED",
            *(f.upper() for f in FLAGS), "FAILED CHECKS", "LAST FLAGGED"]
    ranked = sorted(result["peers"].items(), key=lambda kv: (-kv[1]["credit"], kv[0]))
    lines = [head]
    for peer, t in ranked:
        ratio = t["credit_per_claimed"]
        lines.append([peer, str(t["rounds"]), f"{t['claimed']:.0f}", f"{t['counted']:.0f}", f"{t['credit']:.0f}",
                      "-" if ratio is None else f"{ratio:.3f}", str(t["flagged"]),
                      *(str(t["flags"][f]) for f in FLAGS), str(t["failed_checks"]), str(t["last_flagged"] or "-")])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            for line in lines]


def run_totals(args: argparse.Namespace) -> int:
    if not args.checkpoint_dir:
        raise UsageError("ledger: needs --checkpoint-dir DIR (or `ledger verify FILE`)")
    first, last = parse_rounds(args.rounds)
    path = os.path.join(args.checkpoint_dir, FILE_NAME)
    if not os.path.isfile(path):
        raise UsageError(f"--checkpoint-dir: no {FILE_NAME} in {args.checkpoint_dir} "
                         "(a node writes it with every checkpoint)")
    result = totals(_read(path, "--checkpoint-dir"), first, last)
    if args.json:
        print(json.dumps({"file": path, **result}, indent=2))
        return EXIT_OK
    span = ("no rounds" if result["entries"] == 0
            else f"rounds {result['first_round']}..{result['last_round']} ({result['entries']} entries)")
    print(f"ledger {path}: {span}, not verified (gonka-node ledger verify {path})")
    for line in _table(result):
        print(line.rstrip())
    return EXIT_OK


def run_verify(args: argparse.Namespace) -> int:
    from p2p.ledgerfile import NotLedgerLines, read_ledger, verify_ledger

    path = args.file
    if not os.path.isfile(path):
        raise UsageError(f"ledger verify: no file {path}")
    try:
        certs = read_ledger(path)
    except OSError as e:
        raise UsageError(f"ledger verify: cannot read {path}: {e.strerror or e}") from None
    except NotLedgerLines as e:
        raise UsageError(f"ledger verify: {path} is not a ledger file: {e}") from None
    except ValueError as e:  # a ledger line with malformed values: the file does not verify
        report(f"ledger {path}: {e}")
        return EXIT_RUNTIME
    ok, _, reason = verify_ledger(certs)
    if not ok:
        report(f"ledger {path}: {reason}")
        return EXIT_RUNTIME
    if not certs:
        print(f"ledger {path}: no entries")
        return EXIT_OK
    start = certs[0].round
    unchecked = "" if start == 1 else f"; it starts at round {start}, whose prev is not checked against anything"
    print(f"ledger {path}: {reason} verified, chain unbroken{unchecked}")
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    if args.ledger_command == "verify":
        given = [f for f, v in (("--checkpoint-dir", args.checkpoint_dir), ("--rounds", args.rounds),
                                ("--json", args.json)) if v]
        if given:
            raise UsageError(f"ledger verify: takes FILE only, not {given[0]}")
        return run_verify(args)
    return run_totals(args)
