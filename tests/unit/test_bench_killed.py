"""The killed-member benchmark's reading of the survivors' logs. Pure: no testbed, no processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from benchmarks import killed  # noqa: E402

pytestmark = pytest.mark.timeout(10)


def test_the_kill_is_the_first_shrunken_commit_after_a_full_one():
    # A node that started late: the first rounds had 3 of 4 members, which is not the kill.
    seen = [{"members": m} for m in (3, 3, 4, 4, 3, 3)]
    assert killed.after_the_kill(seen, 4) == (2, 4)
    assert killed.after_the_kill(seen[:4], 4) is None  # not killed yet
    assert killed.after_the_kill([{"members": 3}] * 3, 4) is None  # never all together


def test_survivors_view_reads_round_times_from_commit_lines(tmp_path):
    lines = []
    for second, members in ((0, 4), (10, 4), (20, 4), (35, 3), (45, 3)):
        lines.append(f"2026-12-05 07:00:{second:02d},000 INFO gonka.node: committed round={second} hash=ab "
                     f"members={members} group=g loss=1.0 eval_loss=1.0 allreduce=1.0s")
    lines.insert(3, "2026-12-05 07:00:30,000 INFO p2p.rounds: aborted round=3 reason=truncated")
    log = tmp_path / "node0" / "node.log"
    log.parent.mkdir()
    log.write_text("\n".join(lines) + "\n")
    view = killed.survivors_view([log], 4)
    assert view == {"normal_s": 10.0, "killed_round_s": 15.0, "members": 3, "aborted": 1}
