"""`gonka-node admit`: the operator's side of a closed swarm.

An operator makes one authority key (``--new-authority``), gives its public key
to every node (``--swarm-authority``), and signs each peer id it admits into a
run for a period (a membership certificate, ``--member-cert`` on that node).
Members then admit each other without anyone redistributing lists. The
signing itself is in p2p/membership.py; this file is flags and files.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone

from node.errors import EXIT_USAGE, report

EPILOG = """\
examples:
  gonka-node admit --new-authority ~/.gonka/authority.key
      prints the public key, e.g. ed25519:3f9a..., for --swarm-authority on every node
  gonka-node admit --authority-key ~/.gonka/authority.key --peer 12D3KooW... --run myrun --days 30 --out peer.cert
      the peer then starts with --identity KEY --swarm-authority ed25519:3f9a... --member-cert peer.cert

Keep the authority key off the training hosts: whoever holds it can admit anyone.
"""

# A certificate's period starts this long before it is signed: hosts' clocks differ a little.
CLOCK_SKEW_SECONDS = 300
MAX_DAYS = 3650


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= MAX_DAYS:
        raise argparse.ArgumentTypeError(f"expected a number of days between 0 and {MAX_DAYS}, got {text!r}")
    return value


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `admit` with the `gonka-node` subcommands."""
    admit = commands.add_parser(
        "admit",
        help="closed swarms: make an operator key, or sign a peer's membership certificate",
        description="Closed swarms: create an operator authority key (--new-authority), or sign a\n"
                    "membership certificate admitting one peer id into one run for a period.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    admit.add_argument("--new-authority", metavar="KEYFILE",
                       help="create a new authority key in KEYFILE (0600, never overwritten) and print its public key")
    admit.add_argument("--authority-key", metavar="KEYFILE", help="the authority key that signs the certificate")
    admit.add_argument("--peer", metavar="PEERID", help="peer id to admit (`gonka-node identity --identity KEY`)")
    admit.add_argument("--run", metavar="RUNID", help="run id the certificate is for (the peers' --run-id)")
    admit.add_argument("--days", metavar="N", type=_days, default=30.0,
                       help="how long the certificate is valid, from now (default: 30)")
    admit.add_argument("--out", metavar="CERTFILE", help="where to write the certificate")


def _fail(message: str) -> int:
    report(message)
    return EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    signing = (args.authority_key, args.peer, args.run, args.out)
    if args.new_authority is not None:
        if any(x is not None for x in signing):
            return _fail("argument --new-authority: not allowed with --authority-key, --peer, --run or --out")
        return _new_authority(args.new_authority)
    for flag, value in zip(("--authority-key", "--peer", "--run", "--out"), signing):
        if value is None:
            return _fail(f"argument {flag}: required (or --new-authority KEYFILE to make a key)")
    return _sign(args)


def _new_authority(path: str) -> int:
    from p2p.membership import new_authority
    from trainer.files import atomic_write

    pem, public = new_authority()
    try:
        atomic_write(path, lambda f: f.write(pem), overwrite=False)  # created 0600
    except FileExistsError:
        return _fail(f"argument --new-authority: {path} exists; refusing to overwrite a key")
    except OSError as exc:
        return _fail(f"argument --new-authority: {path}: cannot write: {exc.strerror or exc}")
    print(public)
    print(f"gonka-node: authority key written to {path}; give every node --swarm-authority {public}",
          file=sys.stderr)
    return 0


def _sign(args: argparse.Namespace) -> int:
    from node.config import NodeConfig
    from p2p.config import _is_peer_id
    from p2p.membership import MAX_KEY_FILE_BYTES, issue_cert, load_authority_key
    from trainer.files import atomic_write

    try:
        with open(args.authority_key, "rb") as f:
            key = load_authority_key(f.read(MAX_KEY_FILE_BYTES + 1))
    except OSError as exc:
        return _fail(f"argument --authority-key: {args.authority_key}: cannot read: {exc.strerror or exc}")
    except ValueError as exc:
        return _fail(f"argument --authority-key: {args.authority_key}: {exc}")
    if not _is_peer_id(args.peer):
        return _fail(f"argument --peer: not a peer id: {args.peer!r}")
    try:
        NodeConfig(run_id=args.run)
    except ValueError as exc:
        return _fail(f"argument --run: {str(exc).partition(': ')[2]}")
    now = int(time.time())
    not_after = now + int(args.days * 86400)
    cert = issue_cert(key, args.run, args.peer, now - CLOCK_SKEW_SECONDS, not_after)
    try:
        atomic_write(args.out, lambda f: f.write(cert))
    except OSError as exc:
        return _fail(f"argument --out: {args.out}: cannot write: {exc.strerror or exc}")
    until = datetime.fromtimestamp(not_after, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"admitted {args.peer} to run {args.run!r} until {until}: {args.out}")
    return 0
