"""Commit certificates signed by a round's members (p2p/signing.py), between in-process peers
over real p2pd daemons on loopback."""

import asyncio
import threading

import pytest
import torch

import p2p.rounds as rounds_module
from p2p.exchange import off_loop
from p2p.group import Group
from tests.unit.peers import rejected, start_peers, stop_peers

pytestmark = pytest.mark.timeout(90)


async def test_members_sign_the_committed_round_into_a_certificate_that_holds():
    peers = await start_peers(3, min_peers=3)
    try:
        rounds = [r for _, r, _ in peers]
        results = await asyncio.wait_for(asyncio.gather(*(r.average([torch.ones(8) * i], 1.0, 0)
                                                          for i, r in enumerate(rounds))), 60)
        assert all(res is not None for res in results)
        # One member applies the round later than the others: their signatures wait for it.
        await asyncio.gather(*(r.certify("genesis", "h1") for r in rounds[:2]))
        await asyncio.sleep(0.2)
        await rounds[2].certify("genesis", "h1")
        for _ in range(100):
            if all(1 in r.commits.certs and len(r.commits.certs[1].signers) == 3 for r in rounds):
                break
            await asyncio.sleep(0.05)
        for (_, r, m) in peers:
            cert = r.commits.certs[1]
            assert cert.holds() and cert.signers == set(cert.members) and (cert.prev, cert.new) == ("genesis", "h1")
            assert rejected(m, "bad_certificate") == 0
    finally:
        await stop_peers(peers)


async def test_a_signature_that_arrives_while_a_member_still_writes_its_residual_counts(monkeypatch):
    # In place, a member writes its residual after the vote, off the event loop. A faster member
    # signs and sends its signature meanwhile: it must count, or that member's certificate of the
    # round never holds and a joiner asking it for the chain finds the chain broken there.
    peers = sorted(await start_peers(2, min_peers=2, codec="int8"), key=lambda p: p[0].peer_id)
    (a, ra, ma), (b, rb, mb) = peers
    slow = threading.Event()  # round 1: b holds its residual write until a's signature arrived
    arrived, during = threading.Event(), []
    write_residual, receive = Group.write_residual, rb.signing.receive

    def slow_for_b(group):
        if group.me == b.peer_id and slow.is_set():
            during.append(arrived.wait(30))  # off the loop: a signs and sends meanwhile
        write_residual(group)

    def noting(sender, *args, **kwargs):
        refused = receive(sender, *args, **kwargs)
        if sender == a.peer_id and slow.is_set():
            arrived.set()
        return refused

    def own_thread(fn, *args):
        # Two processes would each have their tensor thread; in-process the peers share one, and
        # a's entry would queue behind b's held write: b's write takes a thread of its own.
        if getattr(fn, "__func__", None) is slow_for_b and fn.__self__.me == b.peer_id:
            return asyncio.to_thread(fn, *args)
        return off_loop(fn, *args)

    monkeypatch.setattr(Group, "write_residual", slow_for_b)
    monkeypatch.setattr(rounds_module, "off_loop", own_thread)
    monkeypatch.setattr(rb.signing, "receive", noting)
    try:
        await a.refresh_peers()

        async def member(r, round):
            # b in place (views of one vector, donated); a with a copy, which writes no residual
            # after the vote (in-process, both would share the thread that writes it).
            v = torch.randn(4000)
            res = await r.average([v.view(-1)], 1.0, round, donate=r is rb)
            assert res is not None, r.last
            await r.certify(f"h{round}", f"h{round + 1}")
            return res

        await asyncio.wait_for(asyncio.gather(member(ra, 0), member(rb, 0)), 30)
        slow.set()
        await asyncio.wait_for(asyncio.gather(member(ra, 1), member(rb, 1)), 60)
        assert during == [True]  # a's signature reached b while b was still writing its residual
        for _ in range(100):
            if all(2 in r.commits.certs for r in (ra, rb)):
                break
            await asyncio.sleep(0.05)
        for r, m in ((ra, ma), (rb, mb)):
            cert = r.commits.certs.get(2)
            assert cert is not None and cert.holds() and cert.signers == {a.peer_id, b.peer_id}
            assert rejected(m, "bad_certificate") == 0
    finally:
        await stop_peers(peers)


async def test_a_signature_a_member_could_not_take_yet_is_sent_again():
    # The first delivery of a's signature reaches b when b does not know the group (or fails on
    # the way): a sends it again, and b's certificate holds with both signatures.
    peers = sorted(await start_peers(2, min_peers=2), key=lambda p: p[0].peer_id)
    (a, ra, _), (b, rb, _) = peers
    receive, refused = rb.signing.receive, []

    def first_refused(sender, *args, **kwargs):
        if not refused:
            refused.append(sender)
            return "unknown_group"
        return receive(sender, *args, **kwargs)

    rb.signing.receive = first_refused
    try:
        await a.refresh_peers()
        results = await asyncio.wait_for(asyncio.gather(ra.average([torch.ones(8)], 1.0, 0),
                                                        rb.average([torch.zeros(8)], 1.0, 0)), 30)
        assert all(res is not None for res in results)
        await asyncio.gather(rb.certify("h0", "h1"), ra.certify("h0", "h1"))
        assert refused == [a.peer_id]
        cert = rb.commits.certs.get(1)
        assert cert is not None and cert.signers == {a.peer_id, b.peer_id}
    finally:
        await stop_peers(peers)
