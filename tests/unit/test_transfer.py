"""State transfer pieces that need no network: choosing the swarm's state, snapshots."""

import asyncio

import pytest
import torch

from p2p.peertable import PeerRecord, parse_peer_record
from p2p.quorum import follow
from p2p.snapshot import Snapshot

pytestmark = pytest.mark.timeout(60)


def rec(pid: str, rnd: int, h: str, state: str = "training") -> PeerRecord:
    return PeerRecord(pid, state, rnd, h, 0, None, ())


def table(*records: PeerRecord) -> dict[str, PeerRecord]:
    return {r.peer_id: r for r in records}


def test_a_peer_moves_on_when_a_majority_of_the_others_is_ahead():
    # Mid-commit the others show different rounds: a majority ahead is enough to be behind,
    # and the most held state (then the newest) is tried first.
    peers = table(rec("a", 4, "x"), rec("b", 4, "x"), rec("c", 3, "y"), rec("d", 2, "z"))
    assert follow(peers, "me", (2, "z")) == ("behind", [(4, "x", ["a", "b"]), (3, "y", ["c"])])
    assert follow(table(rec("b", 3, "y")), "me", (2, "z")) == ("behind", [(3, "y", ["b"])])  # a swarm of two
    # Two of four others ahead is no majority, but with us it would be one: patient peers go.
    peers = table(rec("a", 4, "x"), rec("b", 4, "x"), rec("c", 2, "z"), rec("d", 2, "z"))
    assert follow(peers, "me", (2, "z")) == ("", [])
    assert follow(peers, "me", (2, "z"), patient=True)[0] == "behind"


def test_a_peer_that_diverged_follows_the_majority_of_its_round():
    peers = table(rec("a", 3, "y"), rec("b", 3, "y"), rec("c", 3, "x"))
    assert follow(peers, "me", (3, "x")) == ("diverged", [(3, "y", ["a", "b"])])
    assert follow(peers, "me", (3, "y")) == ("", [])


def test_one_peer_or_a_minority_announcing_a_newer_round_is_not_followed():
    honest = [rec(p, 4, "o") for p in "abc"]
    assert follow(table(*honest, rec("liar", 1004, "zeros")), "me", (4, "o"), patient=True) == ("", [])
    liars = [rec(p, 1004, "zeros") for p in ("l1", "l2")]
    assert follow(table(*honest, *liars), "me", (4, "o"), patient=True) == ("", [])
    # Behind the honest peers: their state first; the liars' comes later and has no certificates.
    why, candidates = follow(table(*honest, *liars), "me", (3, "n"))
    assert why == "behind" and candidates[0] == (4, "o", ["a", "b", "c"])
    # Quarantined peers vouch for nothing (and still count among the live).
    assert follow(table(*honest[:1], *liars), "me", (3, "n"), patient=True, excluded={"l1", "l2"}) == ("", [])


def test_joiners_and_stopped_peers_do_not_vote():
    peers = table(rec("a", 5, "n"), rec("j", 9, "q", state="joining"), rec("s", 9, "q", state="stopped"))
    assert follow(peers, "me", (0, "g")) == ("behind", [(5, "n", ["a"])])
    assert follow(table(rec("j", 0, "q", state="joining")), "me", (0, "g")) == ("", [])


def test_heartbeat_validation_rejects_garbage():
    ok = parse_peer_record("p" * 30, {"state": "ready", "round": 2, "hash": "ab", "step": 5, "loss": 1.5, "maddrs": []})
    assert ok.round == 2 and ok.state == "ready"
    bad_values = [None, [], {"state": "king", "round": 1, "hash": ""}, {"state": "ready", "round": -1, "hash": ""},
                  {"state": "ready", "round": True, "hash": ""}, {"state": "ready", "round": 1, "hash": "h" * 500},
                  {"state": "ready", "round": 1, "hash": "", "maddrs": "x"}]
    for value in bad_values:
        with pytest.raises(ValueError):
            parse_peer_record("p" * 30, value)
    with pytest.raises(ValueError):
        parse_peer_record("short", {"state": "ready", "round": 1, "hash": ""})


async def serving(peers):
    """A state server on the first of ``peers``, once the second is in its run's table (a donor
    serves only peers it sees there); (server, a download for the second)."""
    from p2p.commits import CommitLog
    from p2p.stateserver import StateServer
    from p2p.transfer import StateDownload

    (donor, _, metrics), (joiner, _, joiner_metrics) = peers
    server = StateServer(donor, metrics, CommitLog(donor.scope, "g"))
    await server.start()
    for _ in range(200):
        if joiner.peer_id in await donor.refresh_peers():
            break
        await asyncio.sleep(0.05)
    return server, StateDownload(joiner, joiner_metrics, server.name)


def test_snapshot_round_trip_and_chunk_digests():
    params = [torch.randn(3, 4), torch.randn(5)]
    momentum = [torch.randn(3, 4), torch.randn(5)]
    snap = Snapshot.build(7, "h", params, momentum, chunk_bytes=64)
    assert len(snap.blob) == 2 * 17 * 4 and len(snap.chunk_digests) == -(-len(snap.blob) // 64)
    state = snap.unpack()
    assert state["round"] == 7
    assert all(torch.equal(a, b) for a, b in zip(state["params"] + state["momentum"], params + momentum))


async def test_a_state_of_more_chunks_than_a_header_holds_is_described_in_full():
    # 16 bytes of digest a chunk: past ~4,000 chunks (about 1.9B parameters at the default
    # 4 MiB) they no longer fit a 64 KiB header; the joiner heard only "no donor serves".
    from p2p.config import MIN_STATE_CHUNK_BYTES as MIN_CHUNK_BYTES
    from tests.unit.peers import start_peers, stop_peers

    peers = await start_peers(2)
    try:
        donor = peers[0][0]
        server, download = await serving(peers)
        numel = 4200 * MIN_CHUNK_BYTES // 8  # 4200 chunks of θ and momentum
        shapes = [[numel]]
        server.snapshot = Snapshot.build(3, "g", [torch.arange(numel, dtype=torch.float32)], [torch.ones(numel)],
                                         MIN_CHUNK_BYTES)
        digest, chunk, digests, shards = await download.meta(donor.peer_id, 3, "g", shapes)
        assert shards == ()
        assert (digest, chunk, list(digests)) == (server.snapshot.digest, MIN_CHUNK_BYTES, server.snapshot.chunk_digests)
        assert len(digests) == 4200
        assert await download.meta(donor.peer_id, 4, "g", shapes) is None  # another round: not this state
    finally:
        await stop_peers(peers)


async def test_a_description_that_does_not_fit_the_state_is_refused():
    # A donor's digest list one short, or chunks smaller than any donor may serve (the list it
    # sends grows past the bound the joiner reads): refused as bad_state_meta, never used.
    import dataclasses

    from p2p.wire import WireError
    from tests.unit.peers import start_peers, stop_peers

    peers = await start_peers(2)
    try:
        (donor, _, _), (_, _, joiner_metrics) = peers
        server, download = await serving(peers)
        params, momentum = [torch.ones(1 << 16)], [torch.zeros(1 << 16)]
        honest = Snapshot.build(3, "g", params, momentum, 1 << 16)
        for lie, reason in ((dataclasses.replace(honest, chunk_digests=honest.chunk_digests[:-1]), "bad_state_meta"),
                            (Snapshot.build(3, "g", params, momentum, 1024), "oversized_payload")):
            server.snapshot = lie
            with pytest.raises(WireError, match=reason):
                await download.meta(donor.peer_id, 3, "g", [[1 << 16]])
            with pytest.raises(RuntimeError, match="no donor serves"):
                await download.run(3, "g", [donor.peer_id], [[1 << 16]])
            assert joiner_metrics.registry.get_sample_value("gonka_node_rejected_messages_total",
                                                            {"reason": reason}) == 1
    finally:
        await stop_peers(peers)


async def test_the_snapshot_is_built_when_a_joiner_first_asks_and_once_per_state(monkeypatch):
    # A copy of θ and the momentum held every round would be 8 bytes per parameter on every
    # host for joins that rarely come: none exists until a peer asks for the state.
    from p2p import stateserver
    from p2p.wire import WireError
    from tests.unit.peers import start_peers, stop_peers

    peers = await start_peers(2)
    try:
        donor = peers[0][0]
        server, download = await serving(peers)
        built = []

        def state(round: int):
            def build():
                built.append(round)
                return Snapshot.build(round, f"h{round}", [torch.full((1 << 14,), float(round))],
                                      [torch.zeros(1 << 14)], 1 << 16)
            return build

        for r in (1, 2, 3):  # three commits, nobody asking
            server.publish(state(r))
        assert built == [] and server.snapshot is None
        snap = await download.run(3, "h3", [donor.peer_id], [[1 << 14]])
        assert built == [3] and snap.unpack()["params"][0].eq(3.0).all()
        assert await download.run(3, "h3", [donor.peer_id], [[1 << 14]])  # served from the same copy
        assert built == [3]
        # The state changes: a download of the old copy under way goes on (it is pinned while
        # its ranges keep coming), one that went quiet gets "moved_on".
        server.publish(state(4))
        assert server.snapshot is None
        old_range = {"op": "range", "round": 3, "hash": "h3", "offset": 0, "length": 1024}
        _, payload = await download._request(donor.peer_id, old_range, max_payload=1 << 16)
        assert payload == bytes(snap.blob[:1024])
        assert (await download.meta(donor.peer_id, 4, "h4", [[1 << 14]])) is not None and built == [3, 4]
        monkeypatch.setattr(stateserver, "PIN_IDLE_TIMEOUTS", 0)  # every pinned copy idle from now on
        server.publish(state(5))
        with pytest.raises(WireError, match="moved_on"):
            await download._request(donor.peer_id, old_range, max_payload=1 << 16)
        assert server._pinned == {}
    finally:
        await stop_peers(peers)


def round_average(numel: int, round: int = 5, seed: int = 0):
    """A committed round's average as its members hold it: int8 pieces of 2^18 values."""
    from p2p.averagelog import RoundAverage
    from p2p.codecs import get_codec
    from p2p.compression import PIECE_ELEMS, piece_bounds

    codec = get_codec("int8")
    vector = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    pieces = piece_bounds(0, numel, codec, PIECE_ELEMS)
    payloads = [codec.encode(vector[s:e].contiguous()) for s, e in pieces]
    return codec, RoundAverage(round, f"h{round - 1}", f"h{round}", codec.name, pieces, payloads)


def test_a_piece_table_must_cover_the_vector_in_order():
    from p2p.averagelog import parse_table

    numel = 3 * (1 << 18) + 5
    codec, avg = round_average(numel)
    table, digests = parse_table(avg.table(), numel, codec)
    assert [(s, e) for s, e, _ in table] == avg.pieces and len(digests) == 4
    import msgpack

    rows = msgpack.unpackb(avg.table())
    lies = [rows[:2] + rows[3:],  # a gap
            [rows[1], rows[0], *rows[2:]],  # out of order
            [*rows[:-2], [rows[3][0], rows[3][1], rows[3][2] + 1], rows[-1]],  # not the codec's size
            [*rows[:-1], rows[-1][:-16]],  # a digest short
            [*rows[:3], [rows[3][0], rows[3][1] + 1, rows[3][2]], rows[-1]]]  # past the end
    for lie in lies:
        with pytest.raises(ValueError):
            parse_table(msgpack.packb(lie), numel, codec)
    with pytest.raises(ValueError):
        parse_table(b"\xc1garbage", numel, codec)


def test_the_average_log_keeps_the_last_rounds_of_one_lineage():
    from p2p.averagelog import AverageLog

    log = AverageLog(2)
    for r in (1, 2, 3):
        log.add(round_average(8, r)[1])
    assert [log.get(r) is not None for r in (1, 2, 3)] == [False, True, True]
    log.add(round_average(8, 2, seed=1)[1])  # round 2 again, on another lineage: round 3 goes
    assert log.get(3) is None and log.get(2).payloads == round_average(8, 2, seed=1)[1].payloads
    none = AverageLog(0)
    none.add(round_average(8, 1)[1])
    assert len(none) == 0


async def test_a_rounds_average_is_fetched_from_donors_that_agree_and_a_liar_is_dropped():
    # A joiner whose download outlasted the swarm's rounds takes those rounds' outer steps from
    # their averages. Donors serve them as their members received them; a donor that serves
    # other bytes under the same description is refused at its first batch and the honest
    # donor serves the rest.
    import dataclasses

    from p2p.commits import CommitLog
    from p2p.compression import CommittedAverage
    from p2p.stateserver import StateServer
    from p2p.transfer import StateDownload
    from tests.unit.peers import start_peers, stop_peers

    numel = 40 * (1 << 18) + 77  # 41 pieces: more than one batch of 4 MiB
    codec, avg = round_average(numel)
    liar_avg = dataclasses.replace(avg, payloads=[bytes(len(p)) for p in avg.payloads], _digests=avg.digests())
    peers = await start_peers(3)
    try:
        (honest, _, h_metrics), (liar, _, l_metrics), (joiner, _, j_metrics) = peers
        for donor, metrics, a in ((honest, h_metrics, avg), (liar, l_metrics, liar_avg)):
            server = StateServer(donor, metrics, CommitLog(donor.scope, "g"), catchup_rounds=2)
            await server.start()
            server.averages.add(a)
        async with asyncio.timeout(20):
            while not all([joiner.peer_id in await d.refresh_peers() for d in (honest, liar)]):
                await asyncio.sleep(0.05)
        download = StateDownload(joiner, j_metrics, server.name)
        got = await download.average(5, "h4", "h5", [honest.peer_id, liar.peer_id], numel, codec)
        assert [bytes(p) for p in got.payloads] == [bytes(p) for p in avg.payloads]
        like = [torch.empty(numel - 77), torch.empty(77)]
        decoded = CommittedAverage(codec, got.pieces, list(got.payloads), like).decoded()
        expected = CommittedAverage(codec, avg.pieces, list(avg.payloads), like).decoded()
        assert all(torch.equal(a, b) for a, b in zip(decoded, expected))
        assert j_metrics.registry.get_sample_value("gonka_node_rejected_messages_total", {"reason": "bad_average"}) >= 1
        # Another lineage's round, or one nobody kept: nothing to fetch.
        for round, prev, new in ((5, "x4", "h5"), (6, "h5", "h6")):
            with pytest.raises(RuntimeError, match="no donor holds"):
                await download.average(round, prev, new, [honest.peer_id], numel, codec)
    finally:
        await stop_peers(peers)


async def test_a_chain_lacking_only_its_newest_certificate_is_waited_for_and_forged_ones_name_the_donor(monkeypatch):
    # An honest donor announces a round a moment before the other members' signatures complete
    # its certificate: the joiner asks again rather than give up (or blame it). A chain that
    # stays short names no liar; a certificate whose signature fails names its donor.
    import p2p.transfer
    from p2p.commits import CommitCertificate, CommitLog
    from p2p.identity import generate_identity
    from p2p.records import RecordSigner
    from p2p.transfer import NoChain
    from tests.unit.peers import start_peers, stop_peers

    monkeypatch.setattr(p2p.transfer, "CERT_WAIT_SECONDS", 2.0)
    signers = sorted((RecordSigner.from_identity(generate_identity()) for _ in range(3)), key=lambda s: s.peer_id)
    peers = await start_peers(2)
    try:
        donor = peers[0][0]
        server, download = await serving(peers)

        def cert(round: int) -> CommitCertificate:
            c = CommitCertificate(donor.scope, round, "g" if round == 1 else f"h{round - 1}", f"h{round}",
                                  tuple(s.peer_id for s in signers))
            for s in signers[:2]:
                assert c.add(s.peer_id, s.public_key, s.sign(c.message()))
            return c

        for r in (1, 2, 3):
            server.commits.add(cert(r))
        mine = CommitLog(donor.scope, "g")
        loop = asyncio.get_running_loop()
        loop.call_later(0.6, server.commits.add, cert(4))  # round 4's signatures arrive late
        started = loop.time()
        chain = await download.fetch_chain(4, "h4", [donor.peer_id], mine)
        assert [c.round for c in chain] == [1, 2, 3, 4] and loop.time() - started >= 0.5
        # Round 6 with no certificate of round 5 below it, round 5 never certified: nobody lied.
        for target in (6, 5):
            with pytest.raises(NoChain, match=f"round {target}") as e:
                await download.fetch_chain(target, f"h{target}", [donor.peer_id], mine)
            assert e.value.liars == []
        forged = cert(5)
        forged.new = "h5-forged"  # changed after signing: no signature on it verifies
        server.commits.add(forged)
        with pytest.raises(NoChain) as e:
            await download.fetch_chain(5, "h5", [donor.peer_id], mine)
        assert e.value.liars == [donor.peer_id]
        assert peers[1][2].registry.get_sample_value("gonka_node_rejected_messages_total",
                                                    {"reason": "bad_certificate"}) == 1
    finally:
        await stop_peers(peers)


async def test_chunks_are_pulled_several_at_a_time_and_a_lying_donor_counts_once(monkeypatch):
    # Far apart, one request in flight per donor carried a chunk every ~5 round trips: a joiner
    # 250 ms away never finished before the swarm's next round. Several are in flight now; a
    # donor whose chunks fail their digests is dropped at the first, and the others serve its share.
    import dataclasses

    from p2p import stateserver, transfer
    from p2p.commits import CommitLog
    from p2p.stateserver import StateServer
    from tests.unit.peers import start_peers, stop_peers

    peers = await start_peers(3)
    try:
        (honest, _, h_metrics), (liar, _, l_metrics), (joiner, _, _) = peers
        params, momentum = [torch.randn(1 << 18)], [torch.randn(1 << 18)]
        good = Snapshot.build(5, "g", params, momentum, 1 << 16)  # 32 chunks
        bad = dataclasses.replace(good, blob=bytes(len(good.blob)))  # the same description, zero bytes
        servers = []
        for donor, metrics, snap in ((honest, h_metrics, good), (liar, l_metrics, bad)):
            server = StateServer(donor, metrics, CommitLog(donor.scope, "g"))
            await server.start()
            server.serve(snap)
            servers.append(server)
        async with asyncio.timeout(20):
            while not all([joiner.peer_id in await d.refresh_peers() for d in (honest, liar)]):
                await asyncio.sleep(0.05)
        in_flight, most = {"n": 0}, {"n": 0}
        serve_range = stateserver.serve_range

        asked = {"liar": 0}

        async def counted(snap, *args):
            asked["liar"] += snap is bad
            if snap is good:
                in_flight["n"] += 1
                most["n"] = max(most["n"], in_flight["n"])
                await asyncio.sleep(0.02)  # a far donor: the next request comes before this one is done
            try:
                await serve_range(snap, *args)
            finally:
                in_flight["n"] -= snap is good

        monkeypatch.setattr(stateserver, "serve_range", counted)
        download = transfer.StateDownload(joiner, peers[2][2], servers[0].name)
        got = await download.run(5, "g", [honest.peer_id, liar.peer_id], [[1 << 18]])
        assert got.blob == good.blob
        assert most["n"] > 1
        # Each bad chunk is counted; none is asked for after the first came back bad.
        bad_chunks = peers[2][2].registry.get_sample_value("gonka_node_rejected_messages_total",
                                                           {"reason": "bad_state_chunk"})
        assert 1 <= bad_chunks <= transfer.PULLS_PER_DONOR
        assert bad_chunks <= asked["liar"] <= transfer.PULLS_PER_DONOR
    finally:
        await stop_peers(peers)
