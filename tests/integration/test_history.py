"""The round history a node keeps next to its checkpoints, and `gonka-node plot` drawing it."""

import json
import subprocess

import pytest

from node import history
from tests.integration.nodes import BIN

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_a_node_writes_one_line_per_committed_round_and_plot_draws_them(nodes, tmp_path):
    # With --log-format json, for log shippers: every line one object, the start-up lines included.
    ckpt = tmp_path / "ckpt"
    node = nodes("hist", "--inner-steps", "2", "--max-rounds", "3", "--checkpoint-dir", str(ckpt),
                 "--set", "data.eval_every=1", "--log-format", "json")
    assert node.wait_exit(150) == 0, node.log()[-3000:]
    logged = [json.loads(line) for line in node.log().splitlines() if line.strip()]  # every line, or this raises
    assert all(set(r) >= {"time", "level", "logger", "message"} for r in logged)
    assert any(r["message"].startswith("listening on /ip4/127.0.0.1/") for r in logged)
    lines = (ckpt / history.FILE_NAME).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["round"] for r in records] == [1, 2, 3]
    assert all(set(r) == set(history.FIELDS) for r in records)
    committed = node.rounds()
    for r in records:
        assert r["params_hash"] == committed[r["round"]] and r["members"] == 1
        assert r["tokens"] > 0 and r["loss"] > 0 and r["eval_loss"] > 0 and r["allreduce_s"] >= 0
    assert records[0]["time"] <= records[1]["time"] <= records[2]["time"]

    with open(ckpt / history.FILE_NAME, "a") as f:
        f.write('{"round": 4, "time"')  # a line cut short by a crash: skipped, not fatal
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


def test_a_checkpoint_that_cannot_be_written_is_counted_and_training_goes_on(nodes, tmp_path):
    import re
    import shutil
    import urllib.request

    from tests.integration.nodes import wait_until

    ckpt = tmp_path / "ckpt"
    node = nodes("full", "--inner-steps", "2", "--checkpoint-dir", str(ckpt), "--metrics-addr", "127.0.0.1:0")
    node.wait_round(1, timeout=90)
    url = wait_until(lambda: re.search(r"^metrics on (\S+)", node.log(), re.M), 30, "metrics address").group(1)

    def metric(name: str) -> float:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        m = re.search(rf"^{name} (\S+)", text, re.M)
        return float(m.group(1)) if m else 0.0

    wait_until(lambda: metric("gonka_node_checkpoints_total") >= 1, 60, "a first checkpoint")
    # The directory turns into a file (as good as a full disk: every write fails).
    shutil.move(ckpt, tmp_path / "saved")
    ckpt.write_text("not a directory")
    failed_at = max(node.rounds())
    wait_until(lambda: metric("gonka_node_checkpoint_failures_total") >= 2, 90, "failed checkpoints to be counted")
    node.wait_round(failed_at + 2, timeout=90)  # training went on
    assert node.proc.poll() is None
    ckpt.unlink()
    shutil.move(tmp_path / "saved", ckpt)  # room again: the next commit's checkpoint is written
    written = metric("gonka_node_checkpoints_total")
    wait_until(lambda: metric("gonka_node_checkpoints_total") > written, 90, "checkpoints to resume")
    node.proc.terminate()
    assert node.wait_exit(60) == 0, node.log()[-3000:]
