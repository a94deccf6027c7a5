"""The round history a node keeps next to its checkpoints, and `gonka-node plot` drawing it."""

import json
import subprocess

import pytest

from node import history
from tests.integration.nodes import BIN

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_a_node_writes_one_line_per_committed_round_and_plot_draws_them(nodes, tmp_path):
    ckpt = tmp_path / "ckpt"
    node = nodes("hist", "--inner-steps", "2", "--max-rounds", "3", "--checkpoint-dir", str(ckpt),
                 "--set", "data.eval_every=1")
    assert node.wait_exit(150) == 0, node.log()[-3000:]
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


def test_json_logs_are_one_object_per_line_banner_included(nodes):
    node = nodes("json", "--inner-steps", "2", "--max-rounds", "1", "--log-format", "json")
    assert node.wait_exit(120) == 0, node.log()[-3000:]
    lines = [line for line in node.log().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line, or this raises
    assert all(set(r) >= {"time", "level", "logger", "message"} for r in records)
    messages = [r["message"] for r in records]
    assert any(m.startswith("listening on /ip4/127.0.0.1/") for m in messages)
    assert any(m.startswith("committed round=1 ") for m in messages)
