"""Closed swarms: membership certificates, the allow-file, `Membership.admits`, `gonka-node admit`."""

from __future__ import annotations

import os
import stat

import msgpack
import pytest

from node import cli
from p2p.config import SwarmConfig
from p2p.identity import generate_identity, peer_id_from_key
from p2p.membership import (MAX_CERT_BYTES, Membership, authority_text, check_cert, issue_cert, load_authority_key,
                            new_authority, parse_authority, parse_cert)

NOW = 1_800_000_000.0
RUN = "run1"


def _peer() -> str:
    return peer_id_from_key(generate_identity())


@pytest.fixture(scope="module")
def authority():
    pem, public = new_authority()
    return load_authority_key(pem), public


@pytest.fixture(scope="module")
def peers():
    return [_peer() for _ in range(3)]


def _cert(authority, peer, run=RUN, start=NOW - 60, end=NOW + 3600) -> bytes:
    return issue_cert(authority[0], run, peer, int(start), int(end))


# ---- certificates ---------------------------------------------------------------------


def test_good_certificate_parses_and_checks(authority, peers):
    data = _cert(authority, peers[0])
    assert len(data) < 200
    cert = parse_cert(data)
    assert (cert.run_id, cert.peer_id) == (RUN, peers[0])
    assert check_cert(cert, parse_authority(authority[1]), RUN, NOW) == ""


@pytest.mark.parametrize("case, expect", [
    ("expired", "expired at"),
    ("future", "valid only from"),
    ("other_run", "issued for run 'run2'"),
    ("wrong_authority", "not signed by the swarm authority"),
])
def test_bad_certificates_are_refused_with_a_reason(authority, peers, case, expect):
    other_key = load_authority_key(new_authority()[0])
    data = {
        "expired": lambda: _cert(authority, peers[0], start=NOW - 7200, end=NOW - 1),
        "future": lambda: _cert(authority, peers[0], start=NOW + 10, end=NOW + 7200),
        "other_run": lambda: _cert(authority, peers[0], run="run2"),
        "wrong_authority": lambda: issue_cert(other_key, RUN, peers[0], int(NOW - 60), int(NOW + 60)),
    }[case]()
    assert expect in check_cert(parse_cert(data), parse_authority(authority[1]), RUN, NOW)


def test_tampered_certificate_fails_its_signature(authority, peers):
    items = msgpack.unpackb(_cert(authority, peers[0]), raw=False)
    items[2] = peers[1]  # someone else's peer id under the first one's signature
    tampered = msgpack.packb(items, use_bin_type=True)
    assert check_cert(parse_cert(tampered), parse_authority(authority[1]), RUN, NOW) == \
        "not signed by the swarm authority"
    items = msgpack.unpackb(_cert(authority, peers[0]), raw=False)
    items[4] += 10**6  # a longer period
    assert "not signed" in check_cert(parse_cert(msgpack.packb(items, use_bin_type=True)),
                                      parse_authority(authority[1]), RUN, NOW)


@pytest.mark.parametrize("data, reason", [
    (b"", "empty"),
    (b"\x00" * (MAX_CERT_BYTES + 1), "larger than"),
    (b"\xc1garbage", "not msgpack"),
    (msgpack.packb(["gonka-member-1", RUN]), "not a membership certificate"),
    (msgpack.packb({"a": 1}), "not msgpack|not a membership certificate"),
    (msgpack.packb(["gonka-member-1", RUN, "not-a-peer", 0, 10, b"x" * 64]), "bad peer id"),
    (msgpack.packb(["gonka-member-1", "", "x", 0, 10, b"x" * 64]), "bad run id"),
    (msgpack.packb(["gonka-member-1", "r" * 65, "x", 0, 10, b"x" * 64]), "bad run id"),
])
def test_malformed_certificates_raise_value_error(data, reason):
    with pytest.raises(ValueError, match=reason):
        parse_cert(data)


def test_malformed_fields_after_the_peer_id(peers):
    p = peers[0]
    for items, reason in [
        (["gonka-member-1", RUN, p, 10, 10, b"x" * 64], "bad validity period"),
        (["gonka-member-1", RUN, p, -1, 10, b"x" * 64], "bad validity period"),
        (["gonka-member-1", RUN, p, 0, 2.5, b"x" * 64], "bad validity period"),
        (["gonka-member-1", RUN, p, True, 10, b"x" * 64], "bad validity period"),
        (["gonka-member-1", RUN, p, 0, 10, b"x" * 63], "bad signature"),
        (["gonka-member-1", RUN, p, 0, 10, "x" * 64], "bad signature"),
    ]:
        with pytest.raises(ValueError, match=reason):
            parse_cert(msgpack.packb(items, use_bin_type=True))


def test_authority_text_round_trips_and_bad_text_is_refused(authority):
    key = parse_authority(authority[1])
    assert authority_text(key) == authority[1]
    for bad in ["", "ed25519:", "ed25519:zz", "rsa:" + "00" * 32, "ed25519:" + "00" * 31]:
        with pytest.raises(ValueError):
            parse_authority(bad)


# ---- Membership -----------------------------------------------------------------------


def _load(tmp_path, peer, now=NOW, **settings) -> Membership:
    return Membership.load(SwarmConfig(**settings), RUN, peer, now)


def test_open_swarm_admits_everyone(peers, tmp_path):
    m = _load(tmp_path, peers[0])
    assert not m.closed and m.admits(peers[1], NOW)[0]


def test_allow_list_admits_only_the_listed(peers, tmp_path):
    m = _load(tmp_path, peers[0], allow=[peers[1]])
    assert m.closed
    assert m.admits(peers[0], NOW) == (True, "this node")
    assert m.admits(peers[1], NOW) == (True, "swarm.allow")
    assert m.admits(peers[2], NOW)[0] is False


def test_certificates_learned_from_peers_admit_for_their_period(authority, peers, tmp_path):
    m = _load(tmp_path, peers[0], authority=authority[1])
    assert not m.admits(peers[1], NOW)[0]
    assert m.learn_cert(_cert(authority, peers[1], end=NOW + 100), NOW) == ""
    assert m.admits(peers[1], NOW) == (True, "certificate")
    assert not m.admits(peers[1], NOW + 100)[0]  # expired meanwhile
    assert "expired" in m.learn_cert(_cert(authority, peers[2], end=NOW - 1), NOW)
    assert "issued for run" in m.learn_cert(_cert(authority, peers[2], run="run2"), NOW)
    assert "not msgpack" in m.learn_cert(b"\xc1", NOW)
    assert not m.admits(peers[2], NOW)[0]


def test_learned_certificates_are_bounded(authority, peers, tmp_path, monkeypatch):
    import p2p.membership

    monkeypatch.setattr(p2p.membership, "MAX_LEARNED_CERTS", 2)
    m = _load(tmp_path, "", authority=authority[1])
    for p in peers:
        assert m.learn_cert(_cert(authority, p), NOW) == ""
    assert [m.admits(p, NOW)[0] for p in peers] == [False, True, True]  # the oldest went


def test_an_allow_list_without_authority_learns_no_certificates(authority, peers, tmp_path):
    m = _load(tmp_path, peers[0], allow=[peers[1]])
    assert m.learn_cert(_cert(authority, peers[2]), NOW) == "no swarm authority"
    assert not m.admits(peers[2], NOW)[0]


def test_allow_file_is_reread_when_it_changes_at_most_once_a_second(peers, tmp_path):
    path = tmp_path / "allow.txt"
    path.write_text(f"# members\n{peers[1]}  # the first one\n\n")
    m = _load(tmp_path, peers[0], allow_file=str(path))
    assert m.admits(peers[1], NOW) == (True, "swarm.allow_file")
    assert not m.admits(peers[2], NOW)[0]
    path.write_text(f"{peers[2]}\n{peers[1]}\n")
    assert not m.admits(peers[2], NOW + 0.5)[0]  # checked at most once a second
    assert m.admits(peers[2], NOW + 1.5)[0]
    path.write_text(f"{peers[2]}\n")
    os.utime(path, ns=(1, 1))
    assert not m.admits(peers[1], NOW + 3)[0]
    # A broken or missing file keeps the last good list rather than admitting or refusing all.
    path.write_text("not-a-peer-id\n")
    assert m.admits(peers[2], NOW + 5)[0]
    path.unlink()
    assert m.admits(peers[2], NOW + 7)[0]


def test_unusable_closed_swarm_settings_name_the_key(authority, peers, tmp_path):
    own = peers[0]
    cases = []
    cases.append((dict(allow_file=str(tmp_path / "missing")), r"^swarm\.allow_file: .*missing: cannot read"))
    bad = tmp_path / "bad.txt"
    bad.write_text("12D3nope\n")
    cases.append((dict(allow_file=str(bad)), r"^swarm\.allow_file: .*line 1: not a peer id"))
    cases.append((dict(authority="ed25519:1234"), r"^swarm\.authority: "))
    for name, data, pattern in [
        ("garbage", b"garbage", r"not a membership certificate"),
        ("other_run", _cert(authority, own, run="run2"), r"issued for run 'run2'"),
        ("other_peer", _cert(authority, peers[1]), rf"issued to peer {peers[1]}, this node is {own}"),
        ("expired", _cert(authority, own, start=NOW - 100, end=NOW - 10), r"expired at"),
        ("unsigned", issue_cert(load_authority_key(new_authority()[0]), RUN, own, int(NOW - 1), int(NOW + 60)),
         r"not signed by the swarm authority"),
    ]:
        path = tmp_path / f"{name}.cert"
        path.write_bytes(data)
        cases.append((dict(authority=authority[1], member_cert=str(path)), r"^swarm\.member_cert: .*" + pattern))
    cases.append((dict(authority=authority[1], member_cert=str(tmp_path / "none.cert")),
                  r"^swarm\.member_cert: .*cannot read"))
    for settings, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            _load(tmp_path, own, **settings)


def test_own_certificate_is_loaded(authority, peers, tmp_path):
    path = tmp_path / "own.cert"
    path.write_bytes(_cert(authority, peers[0]))
    m = _load(tmp_path, peers[0], authority=authority[1], member_cert=str(path))
    assert m.own_cert == path.read_bytes()


# ---- gonka-node admit -----------------------------------------------------------------


def test_admit_makes_a_key_then_signs_a_certificate_a_node_accepts(tmp_path, capsys):
    key = tmp_path / "op" / "authority.key"
    assert cli.main(["admit", "--new-authority", str(key)]) == 0
    public = capsys.readouterr().out.strip()
    assert public.startswith("ed25519:") and "\n" not in public
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    before = key.read_bytes()
    assert cli.main(["admit", "--new-authority", str(key)]) == 2  # never overwritten
    assert "argument --new-authority" in capsys.readouterr().err
    assert key.read_bytes() == before

    peer = _peer()
    out = tmp_path / "peer.cert"
    assert cli.main(["admit", "--authority-key", str(key), "--peer", peer, "--run", RUN, "--days", "2",
                     "--out", str(out)]) == 0
    assert peer in capsys.readouterr().out
    import time

    m = Membership.load(SwarmConfig(authority=public, member_cert=str(out)), RUN, peer, time.time())
    assert m.own_cert == out.read_bytes()
    other = Membership.load(SwarmConfig(authority=public), RUN, _peer(), time.time())
    assert other.learn_cert(out.read_bytes(), time.time()) == ""
    assert other.admits(peer, time.time())[0] and not other.admits(peer, time.time() + 2.1 * 86400)[0]


@pytest.mark.parametrize("argv, flag", [
    (["admit"], "--authority-key"),
    (["admit", "--new-authority", "K", "--peer", "x"], "--new-authority"),
    (["admit", "--authority-key", "{key}", "--peer", "nope", "--run", "r", "--out", "{out}"], "--peer"),
    (["admit", "--authority-key", "{key}", "--peer", "{peer}", "--run", "a b", "--out", "{out}"], "--run"),
    (["admit", "--authority-key", "{key}", "--peer", "{peer}", "--run", "r", "--days", "-1", "--out", "{out}"],
     "--days"),
    (["admit", "--authority-key", "{bad}", "--peer", "{peer}", "--run", "r", "--out", "{out}"], "--authority-key"),
    (["admit", "--authority-key", "{missing}", "--peer", "{peer}", "--run", "r", "--out", "{out}"],
     "--authority-key"),
    (["admit", "--authority-key", "{key}", "--peer", "{peer}", "--run", "r"], "--out"),
])
def test_admit_bad_input_is_one_line_naming_the_flag(tmp_path, capsys, argv, flag):
    key = tmp_path / "a.key"
    key.write_bytes(new_authority()[0])
    bad = tmp_path / "bad.key"
    bad.write_bytes(generate_identity())
    names = dict(key=key, out=tmp_path / "c", peer=_peer(), bad=bad, missing=tmp_path / "missing")
    assert cli.main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("gonka-node: error: ") and flag in err, err
    assert not (tmp_path / "c").exists()
