"""Owner-bound heartbeats: the DHT record validator, alone and inside real DHT nodes on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from p2p.config import SwarmConfig
from p2p.identity import generate_identity
from p2p.membership import Membership, issue_cert, load_authority_key, new_authority
from p2p.records import RecordSigner, RunRecordValidator, max_ttl, peer_table_key
from p2p.swarm import Swarm, peer_id_from

pytestmark = pytest.mark.timeout(90)

RUN = "r"
NOW = 1_800_000_000.0
TTL = max_ttl(2.0)
KEY = DHTID.generate(source=peer_table_key(RUN)).to_bytes()


@pytest.fixture(scope="module")
def signers():
    return [RecordSigner.from_identity(generate_identity()) for _ in range(2)]


def _validator(signer, membership=None, rejects=None):
    membership = membership or Membership(RUN, closed=False, peer_id=signer.peer_id)
    return RunRecordValidator(RUN, signer, membership, TTL, clock=lambda: NOW,
                              on_reject=(rejects.append if rejects is not None else lambda r: None))


def _record(signer, value=None, expiration=NOW + 6, key=KEY, subkey=None) -> DHTRecord:
    """A heartbeat as DHTNode.store builds it, signed by ``signer``'s validator."""
    value = value if value is not None else {"state": "training", "round": 3, "hash": "ab"}
    subkey = MSGPackSerializer.dumps(signer.peer_id if subkey is None else subkey)
    record = DHTRecord(key, subkey, MSGPackSerializer.dumps(value), expiration)
    return dataclasses.replace(record, value=_validator(signer).sign_value(record))


def _refused(validator, record, reason, rejects):
    rejects.clear()
    assert validator.validate(record) is False
    assert rejects == [reason]


def test_a_signed_heartbeat_is_accepted_and_stripped_back(signers):
    me, other = signers
    v = _validator(me)
    record = _record(other)
    assert v.validate(record) and v.validate(record)  # the second from the cache
    assert MSGPackSerializer.loads(v.strip_value(record)) == {"state": "training", "round": 3, "hash": "ab"}
    assert v.check(record) == other.peer_id


def test_forged_signature(signers):
    rejects = []
    v = _validator(signers[0], rejects=rejects)
    value, pk, sig, cert = msgpack.unpackb(_record(signers[1]).value)
    forged = bytes([sig[0] ^ 1]) + sig[1:]
    record = _record(signers[1])
    _refused(v, dataclasses.replace(record, value=msgpack.packb([value, pk, forged, cert])), "record_bad_signature",
             rejects)
    # The same signature over another value.
    other_value = MSGPackSerializer.dumps({"state": "training", "round": 99, "hash": "ff"})
    _refused(v, dataclasses.replace(record, value=msgpack.packb([other_value, pk, sig, cert])),
             "record_bad_signature", rejects)


def test_foreign_key_cannot_write_another_peers_entry(signers):
    victim, attacker = signers
    rejects = []
    v = _validator(victim, rejects=rejects)
    # The attacker signs an entry under the victim's subkey with its own key...
    record = DHTRecord(KEY, MSGPackSerializer.dumps(victim.peer_id), MSGPackSerializer.dumps({"state": "ready"}),
                       NOW + 5)
    signed = _validator(attacker).sign_value(dataclasses.replace(record, subkey=MSGPackSerializer.dumps(
        attacker.peer_id)))
    _refused(v, dataclasses.replace(record, value=signed), "record_foreign_key", rejects)
    # ...or claims the victim's public key with its own signature.
    value, _, sig, cert = msgpack.unpackb(signed)
    _refused(v, dataclasses.replace(record, value=msgpack.packb([value, victim.public_key, sig, cert])),
             "record_bad_signature", rejects)


def test_replayed_older_record_never_replaces_the_newer_one(signers):
    me, owner = signers
    rejects = []
    v = _validator(me, rejects=rejects)
    old, new = _record(owner, {"round": 1}, NOW + 2), _record(owner, {"round": 2}, NOW + 5)
    storage = DHTLocalStorage()
    key_id = DHTID.from_bytes(KEY)
    assert v.validate(new) and storage.store(key_id, new.value, new.expiration_time, subkey=owner.peer_id)
    # The old record is authentic, but hivemind keeps the later expiration...
    assert v.validate(old) and not storage.store(key_id, old.value, old.expiration_time, subkey=owner.peer_id)
    assert storage.get(key_id).value.get(owner.peer_id).value == new.value
    # ...and the old one cannot be given a later expiration: the signature covers it.
    _refused(v, dataclasses.replace(old, expiration_time=NOW + 8), "record_bad_signature", rejects)


def test_far_future_expiry_is_refused(signers):
    rejects = []
    v = _validator(signers[0], rejects=rejects)
    assert v.validate(_record(signers[1], expiration=NOW + TTL))
    _refused(v, _record(signers[1], expiration=NOW + TTL + 1), "record_far_expiry", rejects)
    _refused(v, _record(signers[1], expiration=float("inf")), "record_far_expiry", rejects)
    _refused(v, _record(signers[1], expiration=float("nan")), "record_far_expiry", rejects)


def test_plain_value_unsigned_value_and_other_keys_are_refused(signers):
    me = signers[0]
    rejects = []
    v = _validator(me, rejects=rejects)
    heartbeat = MSGPackSerializer.dumps({"state": "ready"})
    _refused(v, DHTRecord(KEY, MSGPackSerializer.dumps(None), heartbeat, NOW + 5), "record_plain_value", rejects)
    _refused(v, DHTRecord(KEY, MSGPackSerializer.dumps(me.peer_id), heartbeat, NOW + 5), "record_unsigned", rejects)
    other_key = DHTID.generate(source="gonka:other-run:peers").to_bytes()
    _refused(v, _record(me, key=other_key), "record_other_key", rejects)
    # This node signs only its own entry of the run's table.
    record = DHTRecord(other_key, MSGPackSerializer.dumps(me.peer_id), heartbeat, NOW + 5)
    assert v.sign_value(record) == heartbeat


@pytest.mark.parametrize("value", [b"", b"\xc1", b"\x00" * 200_000, msgpack.packb([1, 2, 3, 4]),
                                   msgpack.packb([b"", b"\x08\x00\x12\x01a", b"", b""]), msgpack.packb({})])
def test_garbage_is_refused_never_raised(signers, value):
    v = _validator(signers[0])
    assert v.validate(DHTRecord(KEY, MSGPackSerializer.dumps(signers[1].peer_id), value, NOW + 1)) is False


def test_a_signed_value_that_does_not_load_as_a_map_is_refused(signers):
    me, owner = signers
    rejects = []
    record = DHTRecord(KEY, MSGPackSerializer.dumps(owner.peer_id), b"\xc1not msgpack", NOW + 5)
    record = dataclasses.replace(record, value=_validator(owner).sign_value(record))
    _refused(_validator(me, rejects=rejects), record, "record_malformed", rejects)


def test_closed_swarm_refuses_strangers_and_learns_certificates_from_heartbeats(signers):
    me, owner = signers
    pem, public = new_authority()
    cert = issue_cert(load_authority_key(pem), RUN, owner.peer_id, int(NOW - 60), int(NOW + 60))
    config = SwarmConfig(authority=public)
    mine = Membership.load(config, RUN, me.peer_id, NOW)
    rejects = []
    v = _validator(me, mine, rejects)
    _refused(v, _record(owner), "not_admitted", rejects)  # no certificate carried
    theirs = Membership(RUN, closed=True, peer_id=owner.peer_id, own_cert=cert)
    record = DHTRecord(KEY, MSGPackSerializer.dumps(owner.peer_id), MSGPackSerializer.dumps({"round": 1}), NOW + 5)
    record = dataclasses.replace(record, value=_validator(owner, theirs).sign_value(record))
    assert v.validate(record)
    assert mine.admits(owner.peer_id, NOW) == (True, "certificate")


# ---- inside real DHT nodes ------------------------------------------------------------

FAST = dict(heartbeat_interval=0.3, gather_timeout=10, round_timeout=10, request_timeout=5)


async def _table(swarm, want: int, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        peers = await swarm.refresh_peers()
        if len(peers) >= want:
            return peers
        await asyncio.sleep(0.1)
    raise AssertionError(f"peer table never reached {want} entries")


async def test_forged_and_plain_values_stored_by_a_peer_are_refused_by_the_dht(monkeypatch):
    import os
    import tempfile

    made, original = [], tempfile.TemporaryDirectory

    def private_dir(**kwargs):
        made.append(original(**kwargs))
        return made[-1]

    monkeypatch.setattr("p2p.swarm.tempfile.TemporaryDirectory", private_dir)
    rejects = {"a": [], "b": []}
    a = await Swarm.start(SwarmConfig(**FAST), RUN, identity_path=None, on_reject=rejects["a"].append)
    # The ephemeral key p2pd uses is the signer's, and its file is gone once p2pd has read it.
    assert a.signer.peer_id == a.peer_id and len(made) == 1 and not os.path.exists(made[0].name)
    b = await Swarm.start(SwarmConfig(bootstrap=a.maddrs, **FAST), RUN, identity_path=None,
                          on_reject=rejects["b"].append)
    try:
        peers = await _table(a, 1)
        assert set(peers) == {b.peer_id}
        key_id = DHTID.generate(source=peer_table_key(RUN))
        # b, hostile, stores straight into a's storage: an unsigned entry under a's own subkey
        # (to mark a as stopped for an hour), and a plain value at the run key.
        forged = MSGPackSerializer.dumps({"state": "stopped", "round": 0, "hash": ""})
        far = time.time() + 3600
        results = await b.dht.protocol.call_store(
            peer_id_from(a.peer_id), keys=[key_id, key_id], values=[forged, forged], expiration_time=[far, far],
            subkeys=[a.peer_id, None])
        assert results == [False, False]
        assert {"record_unsigned", "record_plain_value"} <= set(rejects["a"])
        item = a.dht.protocol.storage.get(key_id)
        assert item is not None and b.peer_id in dict(item.value.items())
        assert await _table(b, 1)  # b still reads a's real entry
        assert (await b.refresh_peers())[a.peer_id].state != "stopped"
    finally:
        await asyncio.gather(a.close(), b.close())


async def test_certified_members_admit_each_other_before_heartbeating(tmp_path):
    from p2p.identity import load_or_create_identity

    pem, public = new_authority()
    key = load_authority_key(pem)
    configs = []
    for name in ("a", "b"):
        identity = str(tmp_path / f"{name}.key")
        cert = tmp_path / f"{name}.cert"
        cert.write_bytes(issue_cert(key, RUN, load_or_create_identity(identity), int(time.time()) - 60,
                                    int(time.time()) + 600))
        configs.append((identity, dict(authority=public, member_cert=str(cert), **FAST)))
    rejects = []
    a = await Swarm.start(SwarmConfig(**configs[0][1]), RUN, identity_path=configs[0][0], on_reject=rejects.append,
                          announce=False)
    b = None
    try:
        # b's bootstrap ping reaches a before any heartbeat: a asks b for its certificate.
        b = await Swarm.start(SwarmConfig(bootstrap=a.maddrs, **configs[1][1]), RUN, identity_path=configs[1][0],
                              on_reject=rejects.append, announce=False)
        assert a.membership.admits(b.peer_id, time.time()) == (True, "certificate")
        assert b.membership.admits(a.peer_id, time.time()) == (True, "certificate")
        assert b.p2p.peer_id in a.dht.protocol.routing_table.uid_to_peer_id.values()
        await asyncio.gather(a._start_heartbeats(), b._start_heartbeats())
        assert set(await _table(b, 1)) == {a.peer_id} and set(await _table(a, 1)) == {b.peer_id}
        assert "not_admitted" not in rejects
    finally:
        await asyncio.gather(a.close(), *([b.close()] if b else []))


async def test_closed_swarm_refuses_an_outsiders_dht_calls():
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2P

    rejects = []
    a = await Swarm.start(SwarmConfig(authority=new_authority()[1], **FAST), RUN, identity_path=None,
                          on_reject=rejects.append)
    # The outsider: plain hivemind, connected to a's p2pd.
    p2p = await P2P.create(initial_peers=a.maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_ipfs=False,
                           nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
    outsider = None
    try:
        outsider = await DHTNode.create(p2p=p2p, wait_timeout=2)
        protocol, target = outsider.protocol, peer_id_from(a.peer_id)
        key_id = DHTID.generate(source=peer_table_key(RUN))
        assert await protocol.call_ping(target) is None
        assert await protocol.call_find(target, [key_id]) is None
        assert await protocol.call_store(target, keys=[key_id], values=[MSGPackSerializer.dumps({"x": 1})],
                                         expiration_time=time.time() + 5, subkeys=[p2p.peer_id.to_base58()]) is None
        assert rejects.count("not_admitted") >= 3
        item = a.dht.protocol.storage.get(key_id)
        assert item is None or p2p.peer_id.to_base58() not in dict(item.value.items())
        assert p2p.peer_id not in a.dht.protocol.routing_table.uid_to_peer_id.values()
        assert not await a.admits(p2p.peer_id.to_base58())
    finally:
        if outsider is not None:
            await outsider.shutdown()
        await p2p.shutdown()
        await a.close()
