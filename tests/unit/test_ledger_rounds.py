"""The ledger in real rounds (in-process peers over p2pd): every member writes the same entry, a
member that sent nothing is flagged and earns nothing, counts a quarter in the next average and
is then left out of the group, without anyone waiting for it."""

import time

import pytest
import torch

from p2p.ledger import DOWN_WEIGHT
from tests.unit.peers import attempt, settle, start_peers, stop_peers
from tests.unit.test_ledger import honest_like

pytestmark = pytest.mark.timeout(120)


async def test_a_free_rider_is_flagged_then_down_weighted_then_left_out():
    peers = await start_peers(4, min_peers=3, gather_timeout=30.0)
    try:
        rounds = [r for _, r, _ in peers]
        await settle(peers)
        liar = rounds[3].swarm.peer_id

        async def one_round(round: int, members: list, seed: int):
            for s, _, _ in peers:
                s.announce(state="training", round=round)
            await settle(peers)
            inputs = honest_like(4, seed=seed)
            inputs[3].zero_()  # the free rider: nothing, with an honest claim of tokens
            return inputs, await attempt([rounds[i] for i in members], [inputs[i] for i in members], round=round)

        # Round 1: all four average; the entry, the same everywhere, flags the free rider.
        inputs, results = await one_round(0, [0, 1, 2, 3], seed=1)
        assert all(res is not None for res in results)
        entries = [r.commits.entries[1] for r in rounds]
        assert len({e.digest() for e in entries}) == 1
        rows = {row.peer: row for row in entries[0].rows}
        assert rows[liar].flags == ("zero",) and rows[liar].credit == 0.0
        assert all(row.flags == () and row.credit == 1.0 for peer, row in rows.items() if peer != liar)
        assert rows[liar].agreement == 0.0 and all(row.agreement > 0.3 for p, row in rows.items() if p != liar)

        # Round 2: it is in the group, counted at a quarter of its weight.
        inputs, results = await one_round(1, [0, 1, 2, 3], seed=2)
        assert all(res is not None for res in results)
        expected = (inputs[0] + inputs[1] + inputs[2]) / (3 + DOWN_WEIGHT)
        assert torch.allclose(results[0][0], expected, rtol=1e-5, atol=1e-6)
        rows = {row.peer: row for row in rounds[0].commits.entries[2].rows}
        assert rows[liar].factor == DOWN_WEIGHT and rows[liar].counted == DOWN_WEIGHT and rows[liar].flags

        # Round 3: left out. The honest three average without waiting for it (it is live, and
        # ready for nothing: a peer that counts must have been waited for up to the gather timeout).
        assert all(r.commits.standing(2).left_out() == {liar} for r in rounds)
        started = time.monotonic()
        inputs, results = await one_round(2, [0, 1, 2], seed=3)
        assert all(res is not None for res in results) and time.monotonic() - started < 20
        assert [len(r.last.members) for r in rounds[:3]] == [3, 3, 3]
        assert liar not in rounds[0].commits.entries[3].members
        assert torch.allclose(results[0][0], (inputs[0] + inputs[1] + inputs[2]) / 3, rtol=1e-5, atol=1e-6)
    finally:
        await stop_peers(peers)
