"""`gonka-node top`: one screen, refreshed, of this node and every peer it sees.

Our own row comes from this node; every other row is what that peer's signed
heartbeat says of itself (unverified: shown, never acted on). ``hash`` marks
each peer whose ``params_hash`` equals ours (``=``) or not (``≠``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

COLUMNS = (("peer", 10), ("state", 9), ("round", 6), ("hash", 14), ("loss", 7), ("eval", 7), ("allreduce", 9),
           ("MB/s", 7), ("wait s", 7), ("aborts", 6), ("rejected", 8))
CLEAR = "\x1b[H\x1b[2J"


def add_parser(commands, control_args) -> None:
    p = commands.add_parser("top", help="watch a running node and its peers, refreshed",
                            description="One screen of this node and every peer it sees: state, round, loss, eval "
                                        "loss, params_hash agreement, last all-reduce time and bandwidth, gather "
                                        "wait, aborts and rejected inputs; refreshed until Ctrl-C.")
    control_args(p)
    p.add_argument("--interval", type=_seconds, default=2.0, metavar="SECONDS", help="refresh every SECONDS (default 2)")
    p.add_argument("--once", action="store_true", help="print one screen and exit")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds between 0.1 and 3600, got {text!r}")
    return value


def run(args: argparse.Namespace, ask) -> int:
    """``ask(cmd)`` sends one control command to the node."""
    if args.json:
        print(json.dumps(ask("top"), indent=2, sort_keys=True))
        return 0
    try:
        while True:
            screen = render(ask("top"), time.time())
            if args.once:
                sys.stdout.write(screen)
                return 0
            sys.stdout.write(CLEAR + screen)
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 0


def _num(value: Any, digits: int = 4) -> str:
    return "-" if not isinstance(value, (int, float)) or isinstance(value, bool) else f"{value:.{digits}f}"


def _count(value: Any) -> str:
    return "-" if not isinstance(value, (int, float)) else str(int(value))


def row(peer: dict, mine: str) -> list[str]:
    h = str(peer.get("params_hash") or "")
    agree = "=" if h and h == mine else "≠" if h else " "
    bw = peer.get("allreduce_bytes_per_s")
    return [("*" if peer.get("self") else " ") + str(peer.get("peer_id", ""))[-8:], str(peer.get("state", "?")),
            _count(peer.get("round")), f"{agree} {h[:12]}", _num(peer.get("loss")), _num(peer.get("eval_loss")),
            _num(peer.get("allreduce_s"), 2), _num(bw / 1e6 if isinstance(bw, (int, float)) else None, 1),
            _num(peer.get("gather_wait_s"), 2), _count(peer.get("aborts")), _count(peer.get("rejected"))]


def _by_reason(counts: Any) -> str:
    if not isinstance(counts, dict) or not counts:
        return "none"
    return ", ".join(f"{k} {int(v)}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:6])


def render(top: dict, now: float) -> str:
    """The screen for one ``top`` reply (pure: tested without a terminal)."""
    if not isinstance(top, dict) or not isinstance(top.get("peers"), list) or not top["peers"]:
        raise RuntimeError(f"unexpected top reply: {str(top)[:200]}")
    peers = [p for p in top["peers"] if isinstance(p, dict)]
    me = next((p for p in peers if p.get("self")), peers[0])
    mine = str(me.get("params_hash") or "")
    others = sorted((p for p in peers if p is not me), key=lambda p: str(p.get("peer_id")))
    agreeing = sum(1 for p in peers if p.get("params_hash") == mine)
    lines = [f"gonka-node top  run {top.get('run_id', '?')}  {time.strftime('%H:%M:%S', time.localtime(now))}  "
             f"{len(peers)} peers, {agreeing} on our params_hash",
             "", "  ".join(name.ljust(width) for name, width in COLUMNS)]
    for peer in [me, *others]:
        lines.append("  ".join(cell.ljust(width) for cell, (_, width) in zip(row(peer, mine), COLUMNS)).rstrip())
    lines += ["", f"this node  aborts: {_by_reason(top.get('aborts'))}",
              f"           rejected: {_by_reason(top.get('rejected'))}",
              f"           quarantined: {_by_reason(top.get('quarantined'))}",
              "", "* this node; other rows are what each peer's heartbeat says. Ctrl-C to quit."]
    return "\n".join(lines) + "\n"
