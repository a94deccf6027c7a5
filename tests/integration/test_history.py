"""The round history a node keeps next to its checkpoints, and `gonka-node plot` drawing it."""

import json
import shutil
import signal
import subprocess

import pytest

from node import history
from tests.integration.nodes import BIN, COMMITTED, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def failed_rounds(node) -> list[int]:
    """The rounds whose checkpoint failed: a node checkpoints a round after logging its commit and
    before it trains the next, so a failure belongs to the last commit logged before it."""
    rounds, last = [], None
    for line in node.log().splitlines():
        m = COMMITTED.search(line)
        if m:
            last = int(m.group(2))
        elif "checkpoint failed, the previous one stays in use" in line and last is not None:
            rounds.append(last)
    return rounds


def test_a_node_writes_one_line_per_committed_round_and_plot_draws_them(nodes, tmp_path):
    # With --log-format json, for log shippers: every line one object, the start-up lines included.
    # Meanwhile its checkpoint directory turns into a file for a while (as good as a full disk):
    # the failures are counted and training goes on.
    ckpt = tmp_path / "ckpt"
    node = nodes("hist", "--inner-steps", "2", "--checkpoint-dir", str(ckpt), "--set", "data.eval_every=1",
                 "--log-format", "json")
    node.wait_round(2, timeout=90)
    shutil.move(ckpt, tmp_path / "saved")
    ckpt.write_text("not a directory")
    failed = wait_until(lambda: failed_rounds(node), 90, "a failed checkpoint")
    failed_at = failed[0]
    # Training went on, and the next round's checkpoint failed too: its history line (written just
    # before its checkpoint) was refused while the directory was gone.
    wait_until(lambda: failed_at + 1 in failed_rounds(node), 90, "the next round's checkpoint to fail")
    ckpt.unlink()
    shutil.move(tmp_path / "saved", ckpt)
    restored_at = max(node.rounds())
    node.wait_round(restored_at + 2, timeout=90)
    node.proc.send_signal(signal.SIGTERM)
    assert node.wait_exit(60) == 0, node.log()[-3000:]
    logged = [json.loads(line) for line in node.log().splitlines() if line.strip()]  # every line, or this raises
    assert all(set(r) >= {"time", "level", "logger", "message"} for r in logged)
    assert any(r["message"].startswith("listening on /ip4/127.0.0.1/") for r in logged)
    lines = (ckpt / history.FILE_NAME).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    rounds = [r["round"] for r in records]  # none for the rounds committed while the directory was gone
    assert rounds == sorted(rounds) and rounds[0] == 1 and failed_at + 1 not in rounds
    assert rounds[-1] >= restored_at + 1
    committed = node.rounds()
    for r in records:
        assert r["params_hash"] == committed[r["round"]] and r["members"] == 1
        assert r["tokens"] > 0 and r["loss"] > 0 and r["eval_loss"] > 0 and r["allreduce_s"] >= 0
    assert all(x["time"] <= y["time"] for x, y in zip(records, records[1:]))

    with open(ckpt / history.FILE_NAME, "a") as f:
        f.write('{"round": 999, "time"')  # a line cut short by a crash: skipped, not fatal
    out = tmp_path / "plot.png"
    result = subprocess.run([str(BIN), "plot", "--checkpoint-dir", str(ckpt), "--out", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    import matplotlib.image

    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (600, 800) and image.std() > 0  # drawn, not blank


def test_plot_names_what_is_missing(tmp_path):
    result = subprocess.run([str(BIN), "plot", "--checkpoint-dir", str(tmp_path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"gonka-node: error: --checkpoint-dir: no {history.FILE_NAME} in {tmp_path}"]

