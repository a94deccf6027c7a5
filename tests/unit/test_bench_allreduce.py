"""The allreduce benchmark's bookkeeping: configurations, bounds and the summary of peer results.

Pure: no testbed, no processes (the benchmark itself needs root and runs from scripts/bench.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from benchmarks import allreduce, allreduce_peer  # noqa: E402


def namespace(**kw) -> argparse.Namespace:
    base = dict(quick=False, peers=4, rate="100mbit", params=1000, repeats=2, systems="gonka-node,hivemind,gloo",
                codecs=None, peer_timeout=None)
    return argparse.Namespace(**{**base, **kw})


def test_configurations_cover_every_codec_and_quick_is_smaller():
    from p2p.codecs import CODECS

    full = allreduce.configurations(namespace())
    assert [c for s, c in full if s == "gonka-node"] == list(CODECS)
    assert ("hivemind", "none") in full and ("gloo", "fp32") in full
    quick = allreduce.configurations(namespace(quick=True))
    assert len(quick) < len(full) and ("gonka-node", "fp32") in quick
    with pytest.raises(ValueError, match="unknown system"):
        allreduce.configurations(namespace(systems="mpi"))
    with pytest.raises(ValueError, match="unknown codec"):
        allreduce.configurations(namespace(codecs="fp8"))


def test_wire_size_uses_the_codec():
    assert allreduce.wire_size("gonka-node", "fp32", 1000) == 4000
    assert allreduce.wire_size("gonka-node", "fp16", 1000) == 2000
    assert allreduce.wire_size("gonka-node", "int8", 1024) == 1024 + 4 * 4  # codes + one fp32 scale per 256
    assert allreduce.wire_size("hivemind", "float16", 1000) == 2000
    assert allreduce.wire_size("gloo", "fp32", 1000) == 4000


def fake_peer(t_enter, t_exit, digest, sent=None, rel_error=1e-8):
    return {"rel_error": rel_error, "repeats": [
        {"t_enter": a, "t_exit": b, "allreduce_s": b - a - 0.1, "sent_bytes": sent, "nic_tx_bytes": 7000,
         "digest": digest} for a, b in zip(t_enter, t_exit)]}


def test_summary_takes_last_in_to_last_out_and_the_median():
    # 100 mbit, 4 peers, 1000 fp32 values: bound = 1.5 * 4000 B / 12.5e6 B/s.
    peers = [fake_peer([0.0, 10.0], [1.0, 12.0], "d", sent=6000),
             fake_peer([0.5, 10.0], [2.0, 11.0], "d", sent=6000)]
    row = allreduce.summarize("gonka-node", "fp32", peers, namespace(), 100_000_000)
    assert row["seconds_all"] == [1.5, 2.0] and row["seconds"] == 1.75
    assert row["bound_seconds"] == pytest.approx(1.5 * 4000 / 12.5e6)
    assert row["ratio_to_bound"] == pytest.approx(1.75 / row["bound_seconds"])
    assert row["wire_bytes_per_peer"] == 6000 and row["identical"] and row["within_tol"]
    assert row["commit_s"] is None  # peers that did not say when their round committed


def test_summary_reports_the_time_to_commit_apart_from_the_decode():
    peers = [fake_peer([0.0, 10.0], [1.0, 12.0], "d"), fake_peer([0.5, 10.0], [2.0, 11.0], "d")]
    for peer, commits in zip(peers, ([0.8, 11.5], [1.7, 10.9])):
        for repeat, t in zip(peer["repeats"], commits):
            repeat["t_commit"] = t
    row = allreduce.summarize("gonka-node", "fp32", peers, namespace(), 100_000_000)
    assert row["commit_s"] == pytest.approx((1.2 + 1.5) / 2) and row["seconds"] == 1.75


def test_summary_reports_cpu_seconds_when_peers_measured_them():
    peers = [fake_peer([0.0, 10.0], [1.0, 12.0], "d"), fake_peer([0.0, 10.0], [1.0, 12.0], "d")]
    row = allreduce.summarize("gloo", "fp32", peers, namespace(), 100_000_000)
    assert row["cpu_s"] is None and row["p2pd_cpu_s"] is None
    for p, cpu in zip(peers, ([1.0, 3.0], [2.0, 5.0])):
        for r, c in zip(p["repeats"], cpu):
            r.update(cpu_s=c, p2pd_cpu_s=c / 2)
    row = allreduce.summarize("gonka-node", "fp32", peers, namespace(), 100_000_000)
    assert row["cpu_s"] == 2.75 and row["p2pd_cpu_s"] == 1.375  # median over repeats of the mean over peers
    assert "cpu_s" in allreduce.COLUMNS


def test_peer_measures_cpu_seconds_of_itself_and_of_a_child():
    import os
    import time

    assert allreduce_peer.cpu_seconds() == pytest.approx(time.process_time(), abs=0.05)
    assert allreduce_peer.cpu_seconds(os.getpid()) >= 0.0
    assert allreduce_peer.cpu_seconds(2**22 + 12345) == 0.0  # a process that does not exist


def test_summary_flags_different_results_and_large_errors():
    peers = [fake_peer([0.0], [1.0], "a"), fake_peer([0.0], [1.0], "b", rel_error=0.5)]
    row = allreduce.summarize("hivemind", "none", peers, namespace(repeats=1), 100_000_000)
    assert not row["identical"] and not row["within_tol"] and row["wire_bytes_per_peer"] is None


def test_peer_error_check_against_the_exact_mean():
    args = argparse.Namespace(params=5000, peers=3, seed=7)
    mean = sum(allreduce_peer.make_input(7 + i, 5000) for i in range(3)) / 3
    assert allreduce_peer.check_result(mean, args)["rel_error"] < 1e-6
    assert allreduce_peer.check_result(torch.zeros(5000), args)["rel_error"] == pytest.approx(1.0)


def test_file_barrier_times_out_naming_the_missing_peer(tmp_path):
    import time

    allreduce_peer.barrier(tmp_path, "x", 0, 1, time.time() + 1)  # alone: passes at once
    with pytest.raises(TimeoutError, match="barrier-y-1"):
        allreduce_peer.barrier(tmp_path, "y", 0, 2, time.time() + 0.05)


def test_the_bound_behind_nat_is_the_owners_uplink():
    # 5 peers, 2 behind NAT: 3 owners each send 2/3 of the vector to the other owners and their
    # part's average to 4 members, 2 vectors in all; 2 (N-1)/N = 1.6 vectors when all own a part.
    rate = 100_000_000
    assert allreduce.link_bound(5, 0, 4000, rate) == pytest.approx(1.6 * 4000 / 12.5e6)
    assert allreduce.link_bound(5, 2, 4000, rate) == pytest.approx(2.0 * 4000 / 12.5e6)
    assert allreduce.link_bound(2, 0, 4000, rate) == pytest.approx(4000 / 12.5e6)
