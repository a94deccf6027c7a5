"""What an attack run (scripts/attack.py) shows: each scenario's result, read from its peers' logs and
/metrics, judged against the goals and the clean run, and printed as a table.

The result's fields are the list in scripts/attack.py's docstring; they go to
DIR/attack.json as they are. Only this module reads the nodes' log lines, so a
changed log line is fixed here.
"""

from __future__ import annotations

import json
import re
import statistics

# What an attacked swarm must achieve: no hostile state adopted, at least 90% of round attempts
# committed, and the eval loss within 2% of the clean run's.
GOALS = {"adopted": 0, "committed_fraction": 0.90, "eval_within": 0.02}

COMMITTED = re.compile(r"committed round=(\d+) hash=([0-9a-f]+) members=(\d+) group=(\w+) .*?eval_loss=(\S+)")
ABORTED = re.compile(r"aborted round=(\d+) group=(\w+) reason=(\w+)")
RESYNCED = re.compile(r"resynced round=(\d+) hash=([0-9a-f]+) reason=(\w+)")
QUARANTINED = re.compile(r"^(\S+ \S+),\d+ WARN\S* p2p.rounds: quarantined peer (\w+) for \S+: (\w+)", re.M)
REFUSED = re.compile(r"not following round (\d+) \(([0-9a-f]+)\)")
CRASH = re.compile(r"^(Traceback .*|.* (ERROR|CRITICAL) .*)$", re.M)
METRIC = re.compile(r'^gonka_node_(rejected_messages|quarantined|state_downloads)_total\{(?:reason|result)="(\w+)"\} (\S+)', re.M)
H = 16  # hash prefix compared: logs, status and heartbeats all carry the full digest


def scenario_result(name: str, honest_peers: list, hostile_peers: list, announced: set[tuple[int, str]],
                    final: dict, reached: int, t0: float, elapsed: float) -> dict:
    """What one scenario's run shows (scripts/attack.py's docstring lists it), from its peers (its
    ``Peer``: name, peer_id, spec, node, metrics, exit, died_at), the (round, hash) the hostile
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
    }


def seconds_per_round(events: list[tuple[float, str, int, str]]) -> float | None:
    """Wall time per round from a peer's first commit to its last (start-up left out)."""
    if len(events) < 2 or events[-1][2] <= events[0][2]:
        return None
    return round((events[-1][0] - events[0][0]) / (events[-1][2] - events[0][2]), 2)


def compare(result: dict, clean: dict | None, stall_bound: float) -> None:
    """Add the eval-loss comparison (at the last round both runs hold) and the goals."""
    r = result
    r["goals"] = {"no_state_adopted": not r["hostile_states_adopted"],
                  "committed_fraction": r["committed_fraction"] >= GOALS["committed_fraction"],
                  "agree": r["final"]["agree"],
                  "no_honest_quarantined": not r["honest_quarantined"],
                  "no_stall": max(r["longest_wait_s"].values()) <= stall_bound}
    if clean is None:
        return
    common = sorted(set(r["eval_loss"]) & set(clean["eval_loss"]))
    if common:
        at = common[-1]
        ours, theirs = r["eval_loss"][at], clean["eval_loss"][at]
        r["eval_vs_clean"] = {"round": at, "eval_loss": ours, "clean_eval_loss": theirs,
                              "relative": round(ours / theirs - 1, 4)}
        r["goals"]["eval_within"] = abs(ours / theirs - 1) <= GOALS["eval_within"]


def top(counts: dict[str, float], n: int = 3) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:n]) or "-"


def print_table(results: list[dict]) -> None:
    print(f"\n{'hostile':<14} {'committed':>14} {'adopted':>7} {'agree':>5} {'eval vs clean':>22} {'honest q.':>9} "
          f"{'max wait':>8} {'s/round':>7}  rejected / quarantined (summed over the honest peers)")
    for r in results:
        ev = r.get("eval_vs_clean")
        evs = f"{ev['eval_loss']:.4f} ({100 * ev['relative']:+.2f}%) @{ev['round']}" if ev else "-"
        c = r["counters"]
        print(f"{'+'.join(r['hostile']) or 'clean':<14} {r['attempts_committed']:>4}/{r['attempts']:<4} "
              f"{100 * r['committed_fraction']:3.0f}% {len(r['hostile_states_adopted']):>7} "
              f"{'yes' if r['final']['agree'] else 'NO':>5} {evs:>22} {len(r['honest_quarantined']):>9} "
              f"{max(r['longest_wait_s'].values()):>7.0f}s {r['seconds_per_round'] or float('nan'):>7.2f}  "
              f"{top(c.get('rejected_messages', {}))} / {top(c.get('quarantined', {}))}")
        for what in ("hostile_states_adopted", "forks", "honest_quarantined", "errors", "died_early"):
            if r[what]:
                print(f"    {what}: {json.dumps(r[what])[:600]}")
