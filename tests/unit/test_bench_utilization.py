"""The utilization benchmark's log reading: phases, the utilization window and the round table.

Pure: synthetic node logs, no testbed, no processes (the benchmark itself needs root
and runs from scripts/bench.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from benchmarks import utilization  # noqa: E402
from benchmarks.swarmbench_common import stamp_to_unix  # noqa: E402

T0 = stamp_to_unix("2026-11-30 21:00:00", "000")


def stamp(t: float) -> str:
    """Unix seconds as a log timestamp (local time, milliseconds)."""
    import time

    ms = round((t % 1) * 1000)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(t))) + f",{ms:03d}"


def trained(t: float, rnd: int, seconds: float, steps: int = 10) -> str:
    return f"{stamp(T0 + t)} INFO gonka.node: trained round={rnd} steps={steps} seconds={seconds:.3f} loss=4.0000"


def committed(t: float, rnd: int, allreduce: float, eval_loss: str = "nan", h: str = "ab12") -> str:
    return (f"{stamp(T0 + t)} INFO gonka.node: committed round={rnd} hash={h} members=4 group=g1 loss=4.0000 "
            f"eval_loss={eval_loss} allreduce={allreduce:.3f}s")


def off_log(phase: float = 4.0, wait: float = 1.0, rounds: int = 4, skew: float = 3.0) -> str:
    """Overlap off: phase k, then its round's all-reduce; phase 1 waits `skew` extra for the others."""
    lines, t = ["listening on /ip4/10.77.0.10/tcp/1/p2p/Qm"], 0.0
    for k in range(1, rounds + 1):
        t += phase
        lines.append(trained(t, k, phase))
        t += wait + (skew if k == 1 else 0)
        lines.append(committed(t, k, wait, eval_loss="2.5000" if k == rounds else "nan"))
    return "\n".join(lines) + "\n"


def test_off_window_is_phases_2_to_r_and_leaves_out_the_start_up_skew():
    row, ps, cs = utilization.node_summary(off_log(), rounds=4)
    assert len(ps) == len(cs) == 4
    # Phases 2..4: 12 s of training over 12 s + the two all-reduces between them.
    assert row["train_seconds"] == pytest.approx(12.0)
    assert row["wall_seconds"] == pytest.approx(14.0, abs=0.002)
    assert row["wait_seconds"] == pytest.approx(2.0, abs=0.002)
    assert row["utilization"] == pytest.approx(12 / 14, abs=1e-3)
    assert row["steady_utilization"] == pytest.approx(8 / 9, abs=1e-3)  # phases 3..4
    assert row["gap_s"] == pytest.approx(1.0, abs=0.002)
    assert row["step_ms"] == pytest.approx(400.0)
    assert row["eval_loss"] == 2.5 and row["resyncs"] == 0 and row["aborts"] == 0 and row["mislabeled"] == 0


def test_overlapped_phases_are_counted_by_place_not_by_label():
    # Eager: phases back to back except a 0.1 s gap; the average of round 1 lands after phase 2
    # ends, so phase 2 is logged as round=1; phase 5 is trained but never sent.
    lines = [trained(4, 1, 4.0), trained(8.1, 1, 4.0), committed(8.5, 1, 2.0), trained(12.2, 3, 4.0),
             committed(12.5, 2, 2.0), trained(16.3, 4, 4.0), committed(16.5, 3, 2.0), committed(20.0, 4, 2.0),
             trained(20.4, 5, 4.0)]
    row, ps, cs = utilization.node_summary("\n".join(lines) + "\n", rounds=4)
    assert [p["round"] for p in ps] == [1, 1, 3, 4]  # the fifth, unsent phase is left out
    assert row["mislabeled"] == 1
    assert row["train_seconds"] == pytest.approx(12.0)
    assert row["wall_seconds"] == pytest.approx(12.2, abs=0.002)
    assert row["utilization"] == pytest.approx(12 / 12.2, abs=1e-3)
    assert row["steady_utilization"] == pytest.approx(8 / 8.1, abs=1e-3)
    assert row["eval_loss"] is None  # overlapped, evaluation comes after the commit line


def test_a_log_short_of_rounds_is_an_error():
    with pytest.raises(ValueError, match="committed 2 and trained 2 of 4"):
        utilization.node_summary(off_log(rounds=2), rounds=4)


def test_round_table_takes_medians_over_nodes_and_compares_hashes():
    a = utilization.node_summary(off_log(wait=1.0), rounds=4)
    b = utilization.node_summary(off_log(wait=2.0).replace("hash=ab12", "hash=cd34", 1), rounds=4)
    c = utilization.node_summary(off_log(wait=3.0), rounds=4)
    table = utilization.round_table([(ps, cs) for _, ps, cs in (a, b, c)])
    assert [r["round"] for r in table] == [1, 2, 3, 4]
    assert table[1]["allreduce_s"] == pytest.approx(2.0) and table[1]["allreduce_max_s"] == pytest.approx(3.0)
    assert table[1]["gap_after_s"] == pytest.approx(2.0, abs=0.002)
    assert table[-1]["gap_after_s"] is None
    assert table[0]["identical"] is False and table[1]["identical"] is True
    assert all(r["members"] == 4 for r in table)
    notes = utilization.round_notes("off", table)
    assert notes[0].startswith("[off] round") and len(notes) == 5 and "NO" in notes[1]


def test_modes_arg():
    assert utilization.modes_arg("off,eager") == ["off", "eager"]
    assert utilization.modes_arg(" eager ") == ["eager"]
    for bad in ("", "off,off", "fast", "off,,bogus"):
        with pytest.raises(argparse.ArgumentTypeError):
            utilization.modes_arg(bad)
