"""The ledger file (p2p/ledgerfile.py) and `gonka-node ledger` / `ledger verify` (node/ledger_cmd.py).

A chain of five rounds signed with real RSA keys by four members (one of them out of
round 3), written as a node writes it; then the ways a file can lie, each caught and
named by its round.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import subprocess
import sys
import types

import pytest

from node import ledger_cmd
from node.checkpoints import NodeCheckpoints
from node.cli import main
from p2p import ledger, ledgerfile
from p2p.commits import CommitCertificate, CommitLog
from p2p.identity import generate_identity
from p2p.ledger import Entry, build_entry
from p2p.ledgerfile import ledger_certificates, ledger_line, read_ledger, verify_ledger, write_ledger
from p2p.records import RecordSigner
from p2p.scores import Score

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCOPE = "gonka.run.0123456789abcdef"
ROUNDS = 5


def state(r: int) -> str:
    return hashlib.sha256(f"state {r}".encode()).hexdigest()


@pytest.fixture(scope="module")
def signers():
    return sorted((RecordSigner.from_identity(generate_identity()) for _ in range(4)), key=lambda s: s.peer_id)


def make_entry(round: int, members: list[str]) -> Entry:
    """An entry with floats that only an exact round trip keeps (thirds, a subnormal, -0.0); in
    round 3 the last member trained a twentieth of what it claims (flagged ``idle``)."""
    n = len(members)
    claimed = [4096.0 + 17 * i + round / 3 for i in range(n)]
    counted = [c * 0.9137 for c in claimed]
    scores = [Score(norm=1.0 + i / 3, agreement=0.5 - i * 1e-7, copy=[0.3, 5e-324, -0.0, 0.1][i % 4],
                    partner=(i + 1) % n, work=0.05 if (round == 3 and i == n - 1) else 1.0 + i / 7)
              for i in range(n)]
    return build_entry(round, members, claimed, counted, [1.0] * n, scores)


def sign(signers, cert: CommitCertificate, signed=None) -> CommitCertificate:
    by_id = {s.peer_id: s for s in signers}
    for peer in signed if signed is not None else cert.members:
        s = by_id[peer]
        assert cert.add(s.peer_id, s.public_key, s.sign(cert.message()))
    return cert


def members_of(signers, round: int) -> tuple[str, ...]:
    ids = [s.peer_id for s in signers]
    return tuple(ids[:3] if round == 3 else ids)  # the fourth member sat out round 3


@pytest.fixture(scope="module")
def chain(signers) -> CommitLog:
    log = CommitLog(SCOPE, state(0))
    for r in range(1, ROUNDS + 1):
        members = members_of(signers, r)
        log.add(sign(signers, CommitCertificate(SCOPE, r, state(r - 1), state(r), members,
                                                make_entry(r, list(members)))))
        log.hold(r, state(r))
    return log


@pytest.fixture
def ledger_dir(tmp_path, chain):
    assert write_ledger(str(tmp_path / "ledger.jsonl"), ledger_certificates(chain)) == ROUNDS
    return tmp_path


def lines_of(path) -> list[str]:
    return path.read_text().splitlines()


def write_lines(path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def assert_fails_naming(capsys, path, round: int, reason: str) -> None:
    code, out, err = cli(capsys, "ledger", "verify", str(path))
    assert code == 1, (out, err)
    assert len(err.splitlines()) == 1 and out == "", err
    assert f"round {round}" in err and reason in err, err



def edit_line(path, index: int) -> dict:
    """Line ``index`` of the ledger file, parsed, to be changed and saved with ``save_line``."""
    return json.loads(lines_of(path)[index])


def save_line(path, index: int, line: dict) -> None:
    lines = lines_of(path)
    lines[index] = json.dumps(line)
    write_lines(path, lines)

@pytest.mark.timeout(30)
def test_an_entry_survives_json_to_the_bytes_its_members_signed(chain):
    for cert in chain.certs.values():
        back = Entry.from_json(json.loads(json.dumps(cert.entry.to_json())))
        assert back.pack() == cert.entry.pack() and back.digest() == cert.entry.digest()


@pytest.mark.timeout(30)
def test_the_written_file_reads_back_as_the_chain_and_verifies(ledger_dir, chain, capsys):
    path = ledger_dir / "ledger.jsonl"
    certs = read_ledger(str(path))
    assert [c.round for c in certs] == list(range(1, ROUNDS + 1))
    for cert in certs:
        original = chain.certs[cert.round]
        assert cert.message() == original.message() and cert.signatures == original.signatures
        assert not cert.holds()  # read unchecked: only verify_ledger checks signatures
    assert verify_ledger(certs) == (True, None, f"rounds 1..{ROUNDS} ({ROUNDS} entries)")
    line = json.loads(lines_of(path)[0])
    assert list(line) == ["scope", "round", "prev", "new", "members", "entry", "signatures"]
    assert list(line["signatures"][0]) == ["peer", "public_key", "signature"]
    code, out, err = cli(capsys, "ledger", "verify", str(path))
    assert code == 0 and err == ""
    assert out == f"ledger {path}: rounds 1..{ROUNDS} ({ROUNDS} entries) verified, chain unbroken\n"


@pytest.mark.timeout(60)
def test_verify_through_the_installed_entry_point(ledger_dir):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GONKA_")}
    environ["PYTHONPATH"] = ROOT
    path = str(ledger_dir / "ledger.jsonl")
    result = subprocess.run([sys.executable, "-m", "node.cli", "ledger", "verify", path], capture_output=True,
                            text=True, env=environ, cwd=ROOT, timeout=50)
    assert result.returncode == 0 and "verified, chain unbroken" in result.stdout, result


@pytest.mark.timeout(30)
def test_a_file_that_starts_later_says_its_first_prev_is_unchecked(ledger_dir, capsys):
    path = ledger_dir / "ledger.jsonl"
    write_lines(path, lines_of(path)[2:])
    code, out, _ = cli(capsys, "ledger", "verify", str(path))
    assert code == 0 and "rounds 3..5 (3 entries) verified" in out
    assert "starts at round 3, whose prev is not checked" in out


@pytest.mark.timeout(30)
def test_a_changed_number_in_an_entry_fails_that_rounds_signatures(ledger_dir, capsys):
    path = ledger_dir / "ledger.jsonl"
    line = edit_line(path, 2)
    line["entry"]["rows"][1]["claimed"] += 1000.0  # still a float, still a well-formed entry
    save_line(path, 2, line)
    assert_fails_naming(capsys, path, 3, "signatures do not hold (0 of 3)")


@pytest.mark.timeout(30)
def test_signatures_below_the_majority_fail_that_round(ledger_dir, capsys):
    path = ledger_dir / "ledger.jsonl"
    line = edit_line(path, 1)
    line["signatures"] = line["signatures"][:2]  # 2 of 4 members: not more than half
    save_line(path, 1, line)
    assert_fails_naming(capsys, path, 2, "signatures do not hold (2 of 4)")


@pytest.mark.timeout(30)
def test_a_signature_under_another_members_name_does_not_count(ledger_dir, capsys):
    path = ledger_dir / "ledger.jsonl"
    line = edit_line(path, 0)
    sigs = line["signatures"]
    sigs[0]["public_key"], sigs[0]["signature"] = sigs[1]["public_key"], sigs[1]["signature"]
    sigs[2]["signature"] = sigs[3]["signature"]
    save_line(path, 0, line)
    assert_fails_naming(capsys, path, 1, "signatures do not hold (2 of 4)")


@pytest.mark.timeout(30)
def test_swapped_missing_and_repeated_lines_break_the_chain(ledger_dir, capsys):
    path = ledger_dir / "ledger.jsonl"
    lines = lines_of(path)
    write_lines(path, [lines[0], lines[2], lines[1], *lines[3:]])
    assert_fails_naming(capsys, path, 3, "out of order after round 1")
    write_lines(path, [lines[0], lines[1], *lines[3:]])
    assert_fails_naming(capsys, path, 4, "missing round 3 after round 2")
    write_lines(path, [lines[0], lines[1], lines[1], *lines[2:]])
    assert_fails_naming(capsys, path, 2, "out of order after round 2")


@pytest.mark.timeout(30)
def test_a_fork_signed_by_its_members_is_named_by_its_round(ledger_dir, signers, capsys):
    path = ledger_dir / "ledger.jsonl"
    lines = lines_of(path)
    members = members_of(signers, 4)
    forged = sign(signers, CommitCertificate(SCOPE, 4, state(-1), state(4), members, make_entry(4, list(members))))
    assert forged.holds()
    lines[3] = ledger_line(forged)
    write_lines(path, lines)
    assert_fails_naming(capsys, path, 4, f"forks: prev {state(-1)} is not round 3's new {state(3)}")


@pytest.mark.timeout(30)
def test_another_runs_line_and_a_malformed_line_are_named(ledger_dir, signers, capsys):
    path = ledger_dir / "ledger.jsonl"
    lines = lines_of(path)
    members = members_of(signers, 2)
    other = sign(signers, CommitCertificate("another.run", 2, state(1), state(2), members,
                                            make_entry(2, list(members))))
    write_lines(path, [lines[0], ledger_line(other), *lines[2:]])
    assert_fails_naming(capsys, path, 2, "scope 'another.run'")
    line = json.loads(lines[1])
    line["entry"]["rows"].pop()  # the entry's members are no longer the certificate's
    write_lines(path, [lines[0], json.dumps(line), *lines[2:]])
    assert_fails_naming(capsys, path, 2, "line 2 (round 2)")
    with pytest.raises(ValueError, match=r"line 2 \(round 2\)"):
        read_ledger(str(path))


@pytest.mark.timeout(30)
def test_a_file_that_is_not_a_ledger_or_missing_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "junk.jsonl").write_text("not json\n")
    (tmp_path / "history.jsonl").write_text('{"round": 1, "loss": 2.5}\n')  # JSON lines, not a ledger's
    for path in (tmp_path / "junk.jsonl", tmp_path / "history.jsonl", tmp_path / "missing.jsonl"):
        code, _, err = cli(capsys, "ledger", "verify", str(path))
        assert code == 2 and len(err.splitlines()) == 1 and str(path) in err, err
    (tmp_path / "empty.jsonl").write_text("")
    code, out, _ = cli(capsys, "ledger", "verify", str(tmp_path / "empty.jsonl"))
    assert code == 0 and "no entries" in out


def expected_totals(chain: CommitLog, first: int, last: int) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in range(first, last + 1):
        for row in chain.certs[r].entry.rows:
            t = out.setdefault(row.peer, {"rounds": 0, "claimed": [], "counted": [], "credit": [], "flagged": []})
            t["rounds"] += 1
            for key in ("claimed", "counted", "credit"):
                t[key].append(getattr(row, key))
            if row.flags:
                t["flagged"].append(r)
    return out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rounds, first, last", [(None, 1, ROUNDS), ("2:3", 2, 3), (":2", 1, 2), ("4:", 4, ROUNDS)])
def test_json_totals_are_the_sums_of_the_rounds_asked_for(ledger_dir, chain, capsys, rounds, first, last):
    args = ["ledger", "--checkpoint-dir", str(ledger_dir), "--json"] + (["--rounds", rounds] if rounds else [])
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    result = json.loads(out)
    assert (result["entries"], result["first_round"], result["last_round"]) == (last - first + 1, first, last)
    expected = expected_totals(chain, first, last)
    assert set(result["peers"]) == set(expected)
    for peer, t in result["peers"].items():
        e = expected[peer]
        assert t["rounds"] == e["rounds"]
        for key in ("claimed", "counted", "credit"):
            assert t[key] == math.fsum(e[key])
        assert t["credit_per_claimed"] == math.fsum(e["credit"]) / math.fsum(e["claimed"])
        assert t["flagged"] == len(e["flagged"]) == t["flags"]["idle"]
        assert t["last_flagged"] == (max(e["flagged"]) if e["flagged"] else None)
    flagged = {p for p, t in result["peers"].items() if t["flagged"]}
    assert flagged == ({chain.certs[3].members[-1]} if first <= 3 <= last else set())


@pytest.mark.timeout(30)
def test_the_table_lists_every_peer(ledger_dir, chain, capsys):
    code, out, _ = cli(capsys, "ledger", "--checkpoint-dir", str(ledger_dir))
    lines = out.splitlines()
    assert code == 0 and "rounds 1..5 (5 entries), not verified" in lines[0]
    assert lines[1].split()[:3] == ["PEER", "ROUNDS", "CLAIMED"]
    idle_peer = chain.certs[3].members[-1]
    (row,) = [line.split() for line in lines[2:] if line.startswith(idle_peer)]
    assert row[1] == "5" and row[-1] == "3"  # in every round; last flagged in round 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, names", [
    (["--checkpoint-dir", "{missing}"], ["--checkpoint-dir", "ledger.jsonl"]),
    (["--checkpoint-dir", "{dir}", "--rounds", "x"], ["--rounds", "'x'"]),
    (["--checkpoint-dir", "{dir}", "--rounds", "3"], ["--rounds"]),
    (["--checkpoint-dir", "{dir}", "--rounds", "5:2"], ["--rounds"]),
    (["--checkpoint-dir", "{dir}", "--rounds", "-1:"], ["--rounds"]),
    ([], ["--checkpoint-dir"]),
    (["verify"], ["FILE"]),
    (["--json", "verify", "{dir}/ledger.jsonl"], ["--json"]),
])
def test_bad_usage_is_one_line_and_exit_2(ledger_dir, capsys, args, names):
    args = [a.format(dir=ledger_dir, missing=ledger_dir / "nope") for a in args]
    code, out, err = cli(capsys, "ledger", *args)
    assert code == 2 and out == "", (out, err)
    assert len(err.splitlines()) == 1 and err.startswith("gonka-node: error: "), err
    for name in names:
        assert name in err, err


@pytest.mark.timeout(30)
def test_a_malformed_file_in_the_checkpoint_dir_is_named_with_its_line(ledger_dir, capsys):
    path = ledger_dir / "ledger.jsonl"
    lines = lines_of(path)
    write_lines(path, [lines[0], "[1, 2]"])
    code, _, err = cli(capsys, "ledger", "--checkpoint-dir", str(ledger_dir))
    assert code == 2 and str(path) in err and "line 2" in err, err


@pytest.mark.timeout(30)
def test_the_commands_constants_are_the_libraries():
    # node/ledger_cmd.py keeps its own copies so that `--help` imports neither torch nor hivemind.
    assert ledger_cmd.FILE_NAME == ledgerfile.FILE_NAME and ledger_cmd.FLAGS == ledger.FLAGS


class _Metric:
    def inc(self, *_):
        pass

    def observe(self, *_):
        pass


@pytest.mark.timeout(60)
def test_a_checkpoint_writes_the_ledger_file_of_certificates_that_hold(tmp_path, signers, chain):
    commits = CommitLog(SCOPE, state(0))
    commits.load_state_dict(chain.state_dict())
    members = members_of(signers, ROUNDS + 1)
    # Round 6's certificate does not hold yet (1 of 4 signatures); round 7's predates entries.
    commits.certs[ROUNDS + 1] = sign(signers, CommitCertificate(SCOPE, ROUNDS + 1, state(ROUNDS), state(ROUNDS + 1),
                                                                members, make_entry(ROUNDS + 1, list(members))),
                                     signed=members[:1])
    commits.add(sign(signers, CommitCertificate(SCOPE, ROUNDS + 2, state(ROUNDS + 1), state(ROUNDS + 2), members)))
    worker = types.SimpleNamespace(land=lambda: None, state_dict=lambda: {"round": ROUNDS + 2},
                                   model_info=lambda: {})
    metric = _Metric()
    loop = types.SimpleNamespace(
        worker=worker, round_step=0, swarm=types.SimpleNamespace(fingerprint=None),
        metrics=types.SimpleNamespace(checkpoints=metric, checkpoint_failures=metric, checkpoint_seconds=metric),
        rounds=types.SimpleNamespace(feedback=None, commits=commits))
    asyncio.run(NodeCheckpoints(str(tmp_path), "run", 1).save(loop))
    assert (tmp_path / "latest.pt").exists()
    certs = read_ledger(str(tmp_path / "ledger.jsonl"))
    assert [c.round for c in certs] == list(range(1, ROUNDS + 1))
    assert verify_ledger(certs)[0]
    # What a line costs (the figure in NodeCheckpoints._write_ledger): ~1.2 KB per member per round.
    size = os.path.getsize(tmp_path / "ledger.jsonl") / sum(len(c.members) for c in certs)
    assert 800 < size < 1600, size
