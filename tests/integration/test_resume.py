"""A node stopped (cleanly or with SIGKILL) and restarted from its checkpoint ends in
the same state as a node that never stopped."""

import signal

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.mark.parametrize("overlap", ["off", "eager"])
def test_resume_equals_never_stopping(nodes, tmp_path, overlap):
    # Overlapped, the checkpoint at a round boundary holds where the local copy started
    # and the round not yet sent; the resumed node sends it and carries on identically.
    key = str(tmp_path / "identity.key")  # same peer id -> same data shard
    base = ["--inner-steps", "6", "--identity", key, "--overlap", overlap]
    if overlap != "off":
        # When an average lands depends on timing; taken at a fixed step (the 3rd of the next
        # round, after two from the preview) every run takes the same path.
        base += ["--set", "outer.land_step=3"]

    # The three runs share nothing but the identity (each starts a swarm of its own): side by
    # side, as three hosts would be.
    straight = nodes("straight", *base, "--max-rounds", "4", "--checkpoint-dir", str(tmp_path / "c0"))
    # Clean stop after round 2, then resume to round 4.
    first = nodes("part1", *base, "--max-rounds", "2", "--checkpoint-dir", str(tmp_path / "c1"))
    # SIGKILL right after round 2 committed (somewhere in round 3), then resume to round 4. Its
    # θ and momentum live in memory-mapped files (outer.state_dir), torn by the kill: the resumed
    # node rebuilds them from the checkpoint and ends where the node holding them in RAM does.
    on_disk = ["--set", f"outer.state_dir={tmp_path / 'outer-state'}"]
    victim = nodes("victim", *base, *on_disk, "--max-rounds", "4", "--checkpoint-dir", str(tmp_path / "c2"))
    victim.wait_round(2, timeout=180)
    victim.proc.send_signal(signal.SIGKILL)
    victim.wait_exit(30)
    revived = nodes("revived", *base, *on_disk, "--max-rounds", "4", "--checkpoint-dir", str(tmp_path / "c2"))
    assert first.wait_exit(180) == 0, first.log()[-3000:]
    second = nodes("part2", *base, "--max-rounds", "4", "--checkpoint-dir", str(tmp_path / "c1"))
    assert straight.wait_exit(180) == 0, straight.log()[-3000:]
    expected = straight.status()
    assert second.wait_exit(180) == 0, second.log()[-3000:]
    assert "resumed from" in second.log()
    assert revived.wait_exit(180) == 0, revived.log()[-3000:]
    assert "resumed from" in revived.log()

    for resumed in (second, revived):
        got = resumed.status()
        assert (got["round"], got["params_hash"], got["inner_step"]) == (
            expected["round"], expected["params_hash"], expected["inner_step"])
        assert got["loss"] == expected["loss"]
