"""What an attack run (scripts/attack.py) shows: each scenario's result, read from its peers' logs,
/metrics and ledger files, judged against the goals and the clean run, and printed as tables.

The result's fields are the list in scripts/attack.py's docstring; they go to
DIR/attack.json as they are. Only this module reads the nodes' log lines and ledger
files, so a changed log line is fixed here.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import Counter
from pathlib import Path

from p2p import hostile as hostile_kinds
from p2p.ledger import STANDING_ROUNDS, Entry, Standing, revoked_in
from p2p.ledgerfile import read_ledger

# What an attacked swarm must achieve: no hostile state adopted, at least 90% of round attempts
# committed, and the eval loss within 2% of the clean run's. Against a member that lies about its
# work (the issue's goals for contributions): it earns at most 10% of an honest peer's credit per
# claimed token and is left out of averages within 3 rounds of its first; no honest peer is
# flagged, in any run; honest credit per token of fast and slow hosts within 10%; and the eval
# loss within 1% of the clean run's.
GOALS = {"adopted": 0, "committed_fraction": 0.90, "eval_within": 0.02, "hostile_credit_vs_honest": 0.10,
         "left_out_within_rounds": 3, "honest_flagged": 0, "slow_vs_fast_credit_within": 0.10,
         "contributions_eval_within": 0.01}
# The behaviours of p2p/hostile.py that lie about the work a contribution holds.
LIES_ABOUT_WORK = ("free_ride", "noise", "replay", "overclaim", "shirk", "copy_to", "copy_from")

COMMITTED = re.compile(r"committed round=(\d+) hash=([0-9a-f]+) members=(\d+) group=(\w+) .*?eval_loss=(\S+)")
ABORTED = re.compile(r"aborted round=(\d+) group=(\w+) reason=(\w+)")
RESYNCED = re.compile(r"resynced round=(\d+) hash=([0-9a-f]+) reason=(\w+)")
QUARANTINED = re.compile(r"^(\S+ \S+),\d+ WARN\S* p2p.rounds: quarantined peer (\w+) for \S+: (\w+)", re.M)
REFUSED = re.compile(r"not following round (\d+) \(([0-9a-f]+)\)")
CRASH = re.compile(r"^(Traceback .*|.* (ERROR|CRITICAL) .*)$", re.M)
LEDGER = re.compile(r"ledger round=(\d+) agreement=\S+ work=\S+(?: flagged (.*))?$", re.M)
METRIC = re.compile(r'^gonka_node_(rejected_messages|quarantined|state_downloads)_total\{(?:reason|result)="(\w+)"\} (\S+)', re.M)
H = 16  # hash prefix compared: logs, status and heartbeats all carry the full digest


def scenario_result(name: str, honest_peers: list, hostile_peers: list, announced: set[tuple[int, str]],
                    final: dict, reached: int, t0: float, elapsed: float) -> dict:
    """What one scenario's run shows (scripts/attack.py's docstring lists it), from its peers (its
    ``Peer``: name, peer_id, spec, slow, ledger_file, node, metrics, exit, died_at), the (round, hash) the hostile
    peers announced, whether the honest peers ended on one state (``final``), the round every
    honest peer reached, and when the run started (``t0``) and how long it took."""
    peers = honest_peers + hostile_peers
    logs = {p.name: p.node.log() for p in peers}
    honest = [p.name for p in honest_peers]
    commits = {n: [(int(r), h[:H], int(m), g, float(e)) for r, h, m, g, e in COMMITTED.findall(logs[n])]
               for n in honest}
    aborts = {n: ABORTED.findall(logs[n]) for n in honest}
    resyncs = {n: [(int(r), h[:H], why) for r, h, why in RESYNCED.findall(logs[n])] for n in honest}
    committed_states = {(r, h) for c in commits.values() for r, h, *_ in c}
    groups_ok = {g for c in commits.values() for *_, g, _ in c}
    groups = groups_ok | {g for a in aborts.values() for _, g, _ in a}
    by_round: dict[int, dict[str, list[str]]] = {}  # round -> hash -> honest peers that committed it
    for n, c in commits.items():
        for r, h, *_ in c:
            by_round.setdefault(r, {}).setdefault(h, []).append(n)
    adopted = []
    hostile_only = announced - committed_states
    for n in honest:
        held = [("resynced", r, h) for r, h, _ in resyncs[n]]
        s = final.get("peers", {}).get(n) if not final["agree"] else final
        if s:
            held.append(("final", s["round"], s["params_hash"][:H]))
        for event, r, h in held:
            if (r, h) in hostile_only or (r > 0 and (r, h) not in committed_states):
                why = "announced by a hostile peer" if (r, h) in announced else "committed by no honest peer"
                adopted.append({"peer": n, "event": event, "round": r, "hash": h, "why": why})
    reasons: dict[str, int] = {}
    for a in aborts.values():
        for _, _, why in a:
            reasons[why] = reasons.get(why, 0) + 1
    counters: dict[str, dict[str, float]] = {}
    for p in honest_peers:
        for metric, label, value in METRIC.findall(p.metrics):
            if float(value):
                counters.setdefault(metric, {})
                counters[metric][label] = counters[metric].get(label, 0) + float(value)
    # Who quarantined whom (peer ids appear by their last 8 characters): an honest peer
    # quarantined by another honest peer is a false accusation.
    names = {p.peer_id[-8:]: p.name for p in peers}
    quarantines = [{"by": n, "peer": names.get(q, q), "reason": why, "at": stamp}
                   for n in honest for stamp, q, why in QUARANTINED.findall(logs[n])]
    gaps = {}
    for p in honest_peers:  # the longest time the peer went without committing or re-syncing
        times = [p.node.started] + [t for t, *_ in p.node.events()] + [t0 + elapsed]
        gaps[p.name] = round(max(b - a for a, b in zip(times, times[1:])), 1)
    pace = [seconds_per_round(p.node.events()) for p in honest_peers]
    errors: dict[str, int] = {}  # "peer: line without its time stamp" -> how often
    for n, text in logs.items():
        for line, _ in CRASH.findall(text):
            key = f"{n}: {re.sub(r'^[-0-9]+ [0-9:,]+ ', '', line)[:300]}"
            errors[key] = errors.get(key, 0) + 1
    exits = {p.name: p.exit for p in peers}
    died = {p.name: p.died_at for p in peers if p.died_at is not None}
    return {
        "scenario": name,
        "hostile": [p.spec for p in hostile_peers],
        "peer_ids": {p.name: p.peer_id for p in peers},
        "seconds": round(elapsed, 1),
        "round_reached": reached,
        "attempts": len(groups),
        "attempts_committed": len(groups_ok),
        "committed_fraction": round(len(groups_ok) / max(1, len(groups)), 4),
        "commits_per_peer": {n: len(commits[n]) for n in honest},
        "aborts_per_peer": {n: len(aborts[n]) for n in honest},
        "abort_reasons": reasons,
        "resyncs": {n: resyncs[n] for n in honest if resyncs[n]},
        "refused_to_follow": sum(len(REFUSED.findall(logs[n])) for n in honest),
        "hostile_announced": sorted(announced)[-5:],
        "hostile_states_adopted": adopted,
        # Rounds honest peers committed with different hashes. docs/faults.md allows
        # one kind: a member that heard every vote commits an attempt the others then abort; it is
        # a minority at that round and re-syncs. Two groups of a majority each never may.
        "forks": {r: hs for r, hs in sorted(by_round.items()) if len(hs) > 1},
        "final": final,
        "eval_loss": {r: statistics.median(e for n in honest for rr, _, _, _, e in commits[n] if rr == r)
                      for r in sorted(by_round)},
        "counters": counters,
        "quarantines": quarantines,
        "honest_quarantined": [q for q in quarantines if q["peer"] in honest],
        "longest_wait_s": gaps,
        "seconds_per_round": statistics.median(x for x in pace if x is not None) if any(pace) else None,
        "errors": errors,
        "exit_codes": exits,
        "died_early": died,
        "slow_peers": [p.name for p in honest_peers if p.slow],
        "lies_about_work": bool(hostile_peers) and all(lies_about_work(p.spec) for p in hostile_peers),
        "ledger": scenario_ledger(honest_peers, hostile_peers, logs),
    }


def lies_about_work(spec: str) -> bool:
    """Whether a hostile peer of ``spec`` lies about the work its contribution holds (the goals
    for contributions judge it), rather than about states, weights or the protocol."""
    b = hostile_kinds.parse(spec)
    return any(getattr(b, kind) for kind in LIES_ABOUT_WORK)


def scenario_ledger(honest_peers: list, hostile_peers: list, logs: dict[str, str]) -> dict:
    """``ledger_verdicts`` of the ledger file of the honest peer that holds the most entries, or,
    where no honest peer left a readable file, ``log_verdicts`` of the honest peers' log lines."""
    peer_ids = {p.name: p.peer_id for p in honest_peers + hostile_peers}
    hostile, slow = [p.name for p in hostile_peers], [p.name for p in honest_peers if p.slow]
    best: tuple[list[Entry], str] | None = None
    unread = {}
    for p in honest_peers:
        try:
            entries = [c.entry for c in read_ledger(str(p.ledger_file)) if c.entry is not None]
        except (OSError, ValueError) as e:
            unread[p.name] = str(e)[:200]
            continue
        if best is None or len(entries) > len(best[0]):
            best = entries, f"{p.name}: {Path(p.ledger_file).name}"
    if best is not None:
        out = ledger_verdicts(best[0], peer_ids, hostile, slow)
        out["source"] = best[1]
    else:
        name = max(logs, key=lambda n: len(LEDGER.findall(logs[n])) if n in peer_ids and n not in hostile else -1)
        out = log_verdicts(logs[name], peer_ids, hostile, slow)
        out["source"] = f"{name}: log"
    out["kinds"] = {p.name: short(p.spec) for p in hostile_peers}
    if unread:
        out["unread"] = unread
    return out


def ledger_verdicts(entries: list[Entry], peer_ids: dict[str, str], hostile: list[str], slow: list[str]) -> dict:
    """What a node's ledger entries say of a scenario's peers (``peer_ids``: name -> peer id;
    ``hostile`` and ``slow``: names): per peer, the rounds it was a member of, tokens claimed and
    credited, credit per claimed token (a hostile peer's also relative to the honest peers' median),
    the first round it was a member and flagged, its flags (``flagged_rounds``), and the first
    round whose standing (p2p/ledger.py ``Standing``, from the entries before it) left it out,
    with any round it was a member of while left out (0: the node kept its own rule); for the
    honest peers, who was flagged, and credit per token and tokens per round of fast vs slow hosts."""
    entries = sorted(entries, key=lambda e: e.round)
    by_round = {e.round: e for e in entries}
    flagged_in = flagged_rounds(entries)
    # The standing each round began with, from the entries before it (as its members computed it).
    standings = {e.round: standing([by_round[r] for r in range(e.round - STANDING_ROUNDS, e.round) if r in by_round],
                                   by_round) for e in entries}
    taken = revoked_in(entries)  # credit failed checks take back, as `gonka-node ledger` totals it
    peers = {}
    for name, pid in peer_ids.items():
        rows = [(e.round, row) for e in entries for row in e.rows if row.peer == pid]
        claimed = math.fsum(r.claimed for _, r in rows)
        credit = math.fsum(r.credit for rnd, r in rows if (pid, rnd) not in taken)
        first = rows[0][0] if rows else None
        left_out, while_out = None, 0
        for e in entries:
            if standings[e.round].factor(pid) == 0.0:
                while_out += pid in e.members
                if left_out is None and first is not None and e.round > first:
                    left_out = e.round
        flagged = sorted(flagged_in.get(pid, {}).items())
        peers[name] = {"rounds": len(rows), "claimed": claimed, "credit": credit,
                       "credit_per_token": round(credit / claimed, 4) if claimed > 0 else None,
                       "tokens_per_round": statistics.median(r.claimed for _, r in rows) if rows else None,
                       "first_member": first, "first_flagged": flagged[0][0] if flagged else None,
                       "left_out": left_out, "left_out_after": None if left_out is None else left_out - first,
                       "member_while_left_out": while_out, "flagged": len(flagged),
                       "flags": count_flags(fl for _, fl in flagged)}
    out = {"entries": len(entries), "rounds": [entries[0].round, entries[-1].round] if entries else None}
    return out | honest_figures(peers, hostile, slow)


def flagged_rounds(entries: list[Entry]) -> dict[str, dict[int, set[str]]]:
    """Peer id -> round -> why its contribution to that round counts as flagged, as ``Standing``
    counts it: its row's flags in the round's entry, and the verdicts of a check of it (p2p/checks.py,
    carried by a later entry) that every one of its assigned checkers failed."""
    out: dict[str, dict[int, set[str]]] = {}
    for e in entries:
        for row in e.rows:
            if row.flags:
                out.setdefault(row.peer, {}).setdefault(e.round, set()).update(row.flags)
    records = [c for e in entries for c in getattr(e, "checks", ())]
    if records:
        from p2p.checks import checkers_by_entry, failed

        checkers = checkers_by_entry({e.round: e for e in entries}.get)
        for sampled, rnd in failed(records, checkers):
            why = {f for c in records if (c.sampled, c.round) == (sampled, rnd) for f in c.flags}
            out.setdefault(sampled, {}).setdefault(rnd, set()).update(why)
    return out


def standing(window: list[Entry], by_round: dict[int, Entry]) -> Standing:
    """``Standing`` of ``window``; where its entries carry checks, with the entries they check."""
    if any(getattr(e, "checks", ()) for e in window):
        return Standing(window, by_round.get)
    return Standing(window)


def count_flags(flag_sets) -> dict[str, int]:
    """Flag -> in how many of ``flag_sets``."""
    return dict(sorted(Counter(f for flags in flag_sets for f in flags).items()))


def log_verdicts(text: str, peer_ids: dict[str, str], hostile: list[str], slow: list[str]) -> dict:
    """The part of ``ledger_verdicts`` a node's log lines tell (``ledger round=N ... flagged
    PEER8:flag+flag``): who was flagged, when and how; membership and credit stay None."""
    names = {pid[-8:]: name for name, pid in peer_ids.items()}
    flagged: dict[str, list[tuple[int, list[str]]]] = {name: [] for name in peer_ids}
    rounds = []
    for rnd, listed in LEDGER.findall(text):
        rounds.append(int(rnd))
        for item in listed.split():
            suffix, _, flags = item.partition(":")
            if suffix in names:
                flagged[names[suffix]].append((int(rnd), flags.split("+")))
    peers = {name: {"rounds": None, "claimed": None, "credit": None, "credit_per_token": None,
                    "tokens_per_round": None, "first_member": None, "first_flagged": f[0][0] if f else None,
                    "left_out": None, "left_out_after": None, "member_while_left_out": None, "flagged": len(f),
                    "flags": count_flags(fl for _, fl in f)}
             for name, f in flagged.items()}
    out = {"entries": len(rounds), "rounds": [min(rounds), max(rounds)] if rounds else None}
    return out | honest_figures(peers, hostile, slow)


def honest_figures(peers: dict[str, dict], hostile: list[str], slow: list[str]) -> dict:
    """Add each hostile peer's credit per token relative to the honest median to ``peers``; the
    honest peers' flags and fast vs slow figures (None where the source does not tell)."""
    honest = [n for n in peers if n not in hostile]
    cpt = {n: peers[n]["credit_per_token"] for n in honest if peers[n]["credit_per_token"] is not None}
    typical = statistics.median(cpt.values()) if cpt else None
    for n in hostile:
        mine = peers[n]["credit_per_token"]
        peers[n]["vs_honest"] = round(mine / typical, 4) if mine is not None and typical else None

    def median_of(key: str, names: list[str]) -> float | None:
        values = [peers[n][key] for n in names if peers[n][key] is not None]
        return statistics.median(values) if values else None

    fast = [n for n in honest if n not in slow]
    fast_cpt, slow_cpt = median_of("credit_per_token", fast), median_of("credit_per_token", slow)
    return {"peers": peers, "hostile": hostile, "slow": slow, "honest_credit_per_token": typical,
            "honest_flagged": {n: peers[n]["flags"] for n in honest if peers[n]["flagged"]},
            "fast_credit_per_token": fast_cpt, "slow_credit_per_token": slow_cpt,
            "slow_vs_fast": round(slow_cpt / fast_cpt - 1, 4) if fast_cpt and slow_cpt is not None else None,
            "fast_tokens_per_round": median_of("tokens_per_round", fast),
            "slow_tokens_per_round": median_of("tokens_per_round", slow)}


def ledger_goals(result: dict) -> dict[str, bool | None]:
    """The goals for contributions a scenario's ``ledger`` is judged by (None: the source does
    not tell): no honest peer flagged; with slow hosts, their credit per token within 10% of the
    fast ones'; against liars about work, each earns at most 10% of the honest credit per token
    and is left out within 3 rounds of its first as a member (one never a member: both met)."""
    led, goals = result["ledger"], {}
    goals["no_honest_flagged"] = not led["honest_flagged"]
    if result["slow_peers"]:
        rel = led["slow_vs_fast"]
        goals["slow_vs_fast_credit"] = None if rel is None else abs(rel) <= GOALS["slow_vs_fast_credit_within"]
    if result["lies_about_work"]:
        them = [led["peers"][n] for n in led["hostile"]]
        credit, out = [], []
        for p in them:
            never = p["rounds"] == 0
            credit.append(True if never else None if p["vs_honest"] is None
                          else p["vs_honest"] <= GOALS["hostile_credit_vs_honest"])
            out.append(True if never else None if p["rounds"] is None
                       else p["left_out_after"] is not None and p["left_out_after"] <= GOALS["left_out_within_rounds"])
        goals["hostile_credit"] = None if None in credit else all(credit)
        goals["hostile_left_out"] = None if None in out else all(out)
    return goals


def seconds_per_round(events: list[tuple[float, str, int, str]]) -> float | None:
    """Wall time per round from a peer's first commit to its last (start-up left out)."""
    if len(events) < 2 or events[-1][2] <= events[0][2]:
        return None
    return round((events[-1][0] - events[0][0]) / (events[-1][2] - events[0][2]), 2)


def compare(result: dict, clean: dict | None, stall_bound: float) -> None:
    """Add the eval-loss comparison (at the last round both runs hold) and the goals (the
    ledger's included: ``ledger_goals``)."""
    r = result
    r["goals"] = {"no_state_adopted": not r["hostile_states_adopted"],
                  "committed_fraction": r["committed_fraction"] >= GOALS["committed_fraction"],
                  "agree": r["final"]["agree"],
                  "no_honest_quarantined": not r["honest_quarantined"],
                  "no_stall": max(r["longest_wait_s"].values()) <= stall_bound,
                  **ledger_goals(r)}
    if clean is None:
        return
    common = sorted(set(r["eval_loss"]) & set(clean["eval_loss"]))
    if common:
        at = common[-1]
        ours, theirs = r["eval_loss"][at], clean["eval_loss"][at]
        r["eval_vs_clean"] = {"round": at, "eval_loss": ours, "clean_eval_loss": theirs,
                              "relative": round(ours / theirs - 1, 4)}
        within = GOALS["contributions_eval_within" if r["lies_about_work"] else "eval_within"]
        r["goals"]["eval_within"] = abs(ours / theirs - 1) <= within


def top(counts: dict[str, float], n: int = 3) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:n]) or "-"


def print_table(results: list[dict]) -> None:
    print(f"\n{'hostile':<14} {'committed':>14} {'adopted':>7} {'agree':>5} {'eval vs clean':>22} {'honest q.':>9} "
          f"{'max wait':>8} {'s/round':>7}  rejected / quarantined (summed over the honest peers)")
    for r in results:
        ev = r.get("eval_vs_clean")
        evs = f"{ev['eval_loss']:.4f} ({100 * ev['relative']:+.2f}%) @{ev['round']}" if ev else "-"
        c = r["counters"]
        print(f"{label(r):<14} {r['attempts_committed']:>4}/{r['attempts']:<4} "
              f"{100 * r['committed_fraction']:3.0f}% {len(r['hostile_states_adopted']):>7} "
              f"{'yes' if r['final']['agree'] else 'NO':>5} {evs:>22} {len(r['honest_quarantined']):>9} "
              f"{max(r['longest_wait_s'].values()):>7.0f}s {r['seconds_per_round'] or float('nan'):>7.2f}  "
              f"{top(c.get('rejected_messages', {}))} / {top(c.get('quarantined', {}))}")
        for what in ("hostile_states_adopted", "forks", "honest_quarantined", "errors", "died_early"):
            if r[what]:
                print(f"    {what}: {json.dumps(r[what])[:600]}")


def label(result: dict) -> str:
    """A scenario's name in the tables: its kind as given (``copy``), or its hostile specs."""
    return result.get("label") or "+".join(short(spec) for spec in result["hostile"]) or "clean"


def short(spec: str) -> str:
    """A hostile spec without its paths (``copy_to=/tmp/x/copy`` -> ``copy_to``)."""
    return re.sub(r"\b(copy_to|copy_from)=[^,]*", r"\1", spec)


def pct(x: float | None, signed: bool = False) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%"


def num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def print_ledger_table(results: list[dict]) -> None:
    """The second table: what the ledger says of each scenario's peers (``ledger_verdicts``)."""
    print(f"\nledger verdicts  {'honest: flagged':>15}  {'credit/token fast, slow (slow vs fast)':>40}  "
          f"{'tokens/round fast, slow':>23}  entries (source)")
    print(f"  {'hostile peer':<24} {'rounds in':>9} {'credit/token vs honest':>22} {'member from':>11} "
          f"{'flagged from':>12} {'left out at':>14}  flags")
    for r in results:
        led = r.get("ledger")
        if not led:
            continue
        flagged = sum(led["peers"][n]["flagged"] for n in led["honest_flagged"])
        flags = "; ".join(f"{n} {top(f)}" for n, f in led["honest_flagged"].items())
        span = f"{led['rounds'][0]}..{led['rounds'][1]}" if led["rounds"] else "-"
        print(f"{label(r):<16} {flagged:>15}  {num(led['fast_credit_per_token']):>16}, "
              f"{num(led['slow_credit_per_token'])} ({pct(led['slow_vs_fast'], True):>7}) "
              f"{num(led['fast_tokens_per_round'], '.0f'):>14}, {num(led['slow_tokens_per_round'], '.0f'):>6}  "
              f"{led['entries']} {span} ({led['source']})")
        if flags:
            print(f"    honest flagged: {flags}")
        for name in led["hostile"]:
            p = led["peers"][name]
            who = f"{name} {led.get('kinds', {}).get(name, '')}"
            out = "-" if p["left_out"] is None else f"{p['left_out']} (+{p['left_out_after']})"
            print(f"  {who:<24} {num(p['rounds'], 'd'):>9} {num(p['credit_per_token']):>12} "
                  f"{pct(p['vs_honest']):>9} {num(p['first_member'], 'd'):>11} {num(p['first_flagged'], 'd'):>12} "
                  f"{out:>14}  {top(p['flags'], 4)}"
                  + (f"  (a member {p['member_while_left_out']} times while left out)"
                     if p["member_while_left_out"] else ""))
