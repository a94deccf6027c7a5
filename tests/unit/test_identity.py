"""Identity key files: created once (0600, atomically), stable, never clobbered, read like p2pd."""

from __future__ import annotations

import os
import stat

import pytest

from p2p.identity import generate_identity, load_or_create_identity, peer_id_from_key, peer_id_of


def test_creates_private_key_and_reloads_same_id(tmp_path):
    path = tmp_path / "keys" / "node.key"
    peer_id = load_or_create_identity(str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert peer_id.startswith(("Qm", "12D3"))
    data = path.read_bytes()
    assert load_or_create_identity(str(path)) == peer_id
    assert peer_id_of(str(path)) == peer_id
    assert path.read_bytes() == data
    # No temporary files left behind.
    assert os.listdir(path.parent) == ["node.key"]


def test_ephemeral_keys_differ():
    assert peer_id_from_key(generate_identity()) != peer_id_from_key(generate_identity())


@pytest.mark.parametrize("content", [b"", b"garbage\x00\xff" * 10, b"\x08\x00\x12\x03abc"])
def test_corrupt_file_is_an_error_and_left_alone(tmp_path, content):
    path = tmp_path / "node.key"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"^node\.identity: .*node\.key: "):
        load_or_create_identity(str(path))
    assert path.read_bytes() == content


def test_unreadable_path_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"^node\.identity: "):
        peer_id_of(str(tmp_path / "missing.key"))
    with pytest.raises(ValueError, match=r"^node\.identity: "):
        load_or_create_identity(str(tmp_path))  # a directory


async def test_matches_p2pd_peer_id(tmp_path):
    from hivemind.p2p import P2P

    path = str(tmp_path / "node.key")
    peer_id = load_or_create_identity(path)
    p2p = await P2P.create(
        identity_path=path,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        nat_port_map=False,
        auto_nat=False,
        use_relay=False,
        use_ipfs=False,
    )
    try:
        assert p2p.peer_id.to_base58() == peer_id
    finally:
        await p2p.shutdown()
