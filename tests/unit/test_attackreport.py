"""The attack run's reading of the ledger (scripts/attackreport.py): verdicts per peer from a
hand-made ledger, from the file an honest peer wrote, and from log lines when no file is there.
Pure: no swarm, no processes."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import attackreport  # noqa: E402

from p2p.commits import CommitCertificate  # noqa: E402
from p2p.ledger import Entry, Row  # noqa: E402
from p2p.ledgerfile import write_ledger  # noqa: E402

# Peer ids sort as members do; the last 8 characters name them in log lines.
IDS = {"honest0": "Qm1-honest-0000000a", "honest1": "Qm2-honest-0000000b", "honest2": "Qm3-honest-0000000c",
       "hostile0": "Qm0-hostile-000000x"}
FAST, SLOW = 1000.0, 500.0


def row(name: str, claimed: float, flags: tuple[str, ...] = ()) -> Row:
    return Row(IDS[name], claimed, claimed, 1.0, 1.0, 0.5, 0.5, -1, 1.0, flags, 0.0 if flags else claimed)


def ledger(rounds: int = 6) -> list[Entry]:
    """Honest0 and honest1 fast, honest2 slow; hostile0 sends nothing in rounds 1 and 2, flagged
    both times, and the standing leaves it out from round 3 (two flags in the window)."""
    entries = []
    for r in range(1, rounds + 1):
        rows = [row("honest0", FAST), row("honest1", FAST), row("honest2", SLOW)]
        if r <= 2:
            rows.append(row("hostile0", FAST, ("zero",)))
        entries.append(Entry(r, tuple(sorted(rows, key=lambda x: x.peer))))
    return entries


@pytest.mark.timeout(10)
def test_a_flagged_member_earns_nothing_and_is_left_out_two_rounds_after_its_first():
    out = attackreport.ledger_verdicts(ledger(), IDS, ["hostile0"], ["honest2"])
    them = out["peers"]["hostile0"]
    assert (them["rounds"], them["credit"], them["vs_honest"]) == (2, 0.0, 0.0)
    assert (them["first_member"], them["first_flagged"], them["left_out"], them["left_out_after"]) == (1, 1, 3, 2)
    assert them["flags"] == {"zero": 2} and them["flagged"] == 2 and them["member_while_left_out"] == 0
    assert out["entries"] == 6 and out["rounds"] == [1, 6]
    assert out["honest_flagged"] == {} and out["honest_credit_per_token"] == 1.0
    assert (out["fast_credit_per_token"], out["slow_credit_per_token"], out["slow_vs_fast"]) == (1.0, 1.0, 0.0)
    assert (out["fast_tokens_per_round"], out["slow_tokens_per_round"]) == (FAST, SLOW)


@pytest.mark.timeout(10)
def test_a_member_in_an_average_its_standing_left_it_out_of_is_counted():
    entries = ledger()
    # Round 3 counts the hostile peer although rounds 1 and 2 flagged it: a node broke its own rule.
    rows = sorted([*entries[2].rows, row("hostile0", FAST)], key=lambda x: x.peer)
    entries[2] = Entry(3, tuple(rows))
    them = attackreport.ledger_verdicts(entries, IDS, ["hostile0"], ["honest2"])["peers"]["hostile0"]
    assert (them["rounds"], them["member_while_left_out"], them["left_out"]) == (3, 1, 3)
    assert them["vs_honest"] == pytest.approx(1 / 3, abs=1e-3)  # round 3's credit of 3 claims


@pytest.mark.timeout(10)
def test_goals_judge_liars_slow_hosts_and_honest_flags():
    led = attackreport.ledger_verdicts(ledger(), IDS, ["hostile0"], ["honest2"])
    result = {"ledger": led, "slow_peers": ["honest2"], "lies_about_work": True}
    assert attackreport.ledger_goals(result) == {"no_honest_flagged": True, "slow_vs_fast_credit": True,
                                                 "hostile_credit": True, "hostile_left_out": True}
    # An honest slow host flagged once: flagged, and its credit per token falls to 5/6 of the fast ones'.
    entries = ledger()
    rows = [r if r.peer != IDS["honest2"] else row("honest2", SLOW, ("idle",)) for r in entries[4].rows]
    entries[4] = Entry(5, tuple(rows))
    led = attackreport.ledger_verdicts(entries, IDS, ["hostile0"], ["honest2"])
    goals = attackreport.ledger_goals({"ledger": led, "slow_peers": ["honest2"], "lies_about_work": True})
    assert led["honest_flagged"] == {"honest2": {"idle": 1}}
    assert goals["no_honest_flagged"] is False and goals["slow_vs_fast_credit"] is False


def peers(tmp_path: Path) -> tuple[list, list]:
    def peer(name: str, spec: str | None = None, slow: bool = False):
        return SimpleNamespace(name=name, peer_id=IDS[name], spec=spec, slow=slow,
                               ledger_file=tmp_path / name / "ckpt" / "ledger.jsonl")
    return [peer("honest0"), peer("honest1"), peer("honest2", slow=True)], [peer("hostile0", "free_ride")]


@pytest.mark.timeout(10)
def test_the_scenario_reads_the_longest_honest_ledger_file(tmp_path):
    honest, hostile = peers(tmp_path)
    for p, rounds in ((honest[0], 4), (honest[1], 6)):  # honest2 wrote none
        certs = [CommitCertificate("scope", e.round, f"h{e.round - 1}", f"h{e.round}", e.members, e)
                 for e in ledger(rounds)]
        p.ledger_file.parent.mkdir(parents=True)
        write_ledger(str(p.ledger_file), certs)
    out = attackreport.scenario_ledger(honest, hostile, {})
    assert out["source"] == "honest1: ledger.jsonl" and out["entries"] == 6
    assert out["peers"]["hostile0"]["left_out"] == 3 and out["kinds"] == {"hostile0": "free_ride"}
    assert set(out["unread"]) == {"honest2"}


@pytest.mark.timeout(10)
def test_without_a_file_the_log_lines_tell_who_was_flagged(tmp_path):
    honest, hostile = peers(tmp_path)
    line = "2026-12-07 00:00:0{r},000 INFO p2p.rounds: ledger round={r} agreement=0.5/0.5/0.5/0.0 work=1/1/1/0{f}"
    flagged = f" flagged {IDS['hostile0'][-8:]}:zero+against"
    log = "\n".join(line.format(r=r, f=flagged if r <= 2 else "") for r in range(1, 5))
    out = attackreport.scenario_ledger(honest, hostile, {"honest0": "", "honest1": log, "honest2": "",
                                                         "hostile0": log + log})
    assert out["source"] == "honest1: log" and out["entries"] == 4 and out["rounds"] == [1, 4]
    them = out["peers"]["hostile0"]
    assert (them["first_flagged"], them["flagged"], them["flags"]) == (1, 2, {"zero": 2, "against": 2})
    assert them["credit_per_token"] is None and out["honest_flagged"] == {}
    # Credit and membership are not in the log lines: those goals cannot be judged.
    goals = attackreport.ledger_goals({"ledger": out, "slow_peers": ["honest2"], "lies_about_work": True})
    assert goals == {"no_honest_flagged": True, "slow_vs_fast_credit": None, "hostile_credit": None,
                     "hostile_left_out": None}


@pytest.mark.timeout(10)
def test_liars_about_work_are_told_from_other_hostile_kinds():
    assert all(map(attackreport.lies_about_work, ("free_ride", "overclaim", "copy_from=/tmp/x/copy", "shirk")))
    assert not any(map(attackreport.lies_about_work, ("scale=-1000", "abort", "fake_state")))
    assert attackreport.short("copy_to=/tmp/a b/copy,abort") == "copy_to,abort"


@pytest.mark.timeout(10)
def test_a_check_every_assigned_checker_failed_flags_the_round_it_checked():
    checks = pytest.importorskip("p2p.checks")
    entries = ledger(4)
    sampled, checkers = next(iter(checks.assignments(entries[0].digest(), list(entries[0].members)).items()))
    name = next(n for n, pid in IDS.items() if pid == sampled)

    def record(checker: str, gains: tuple[float, ...]):
        return checks.CheckRecord("scope", 1, sampled, checker, gains, b"key", b"signature")

    # Round 2's entry carries round 1's checks: every checker found nothing to measure (withheld).
    entries[1] = Entry(2, entries[1].rows, checks=tuple(record(c, ()) for c in checkers))
    them = attackreport.ledger_verdicts(entries, IDS, ["hostile0"], ["honest2"])["peers"][name]
    assert (them["flagged"], them["first_flagged"]) == (1, 1)
    assert them["flags"] == ({"zero": 1, "withheld": 1} if name == "hostile0" else {"withheld": 1})
    # ... and earns nothing for it, as `gonka-node ledger` totals it.
    rows = [(e.round, r) for e in entries for r in e.rows if r.peer == sampled]
    assert rows[0][0] == 1 and (rows[0][1].credit > 0 or name == "hostile0")
    assert them["credit"] == pytest.approx(sum(r.credit for _, r in rows[1:]))
    # One checker's word is not enough.
    clean = (2.0, 2.2, 2.2, 2.2, 2.0, 2.2, 2.3)  # ahead on its windows as the checker on its own
    entries[1] = Entry(2, entries[1].rows, checks=(record(checkers[0], ()), record(checkers[1], clean)))
    assert attackreport.flagged_rounds(entries).get(sampled, {}).get(1, set()) <= {"zero"}
