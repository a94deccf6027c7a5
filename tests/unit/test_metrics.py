"""The Prometheus exporter serves every metric the dashboards rely on."""

from __future__ import annotations

import pathlib
import re
import socket
import urllib.request

import pytest

from node.metrics import OTHER, REASONS, NodeMetrics, reason_label

pytestmark = pytest.mark.timeout(30)
ROOT = pathlib.Path(__file__).resolve().parents[2]

METRIC_NAMES = [
    "gonka_node_info",
    "gonka_node_rounds_total",
    "gonka_node_round",
    "gonka_node_rounds_aborted_total",
    "gonka_node_inner_steps_total",
    "gonka_node_tokens_total",
    "gonka_node_loss",
    "gonka_node_eval_loss",
    "gonka_node_peers",
    "gonka_node_round_members",
    "gonka_node_allreduce_seconds",
    "gonka_node_gather_wait_seconds",
    "gonka_node_inner_step_seconds",
    "gonka_node_sent_bytes_total",
    "gonka_node_received_bytes_total",
    "gonka_node_averaging_failures_total",
    "gonka_node_rejected_messages_total",
    "gonka_node_state_downloads_total",
    "gonka_node_state_download_seconds",
    "gonka_node_state_served_total",
    "gonka_node_resyncs_total",
    "gonka_node_checkpoints_total",
    "gonka_node_checkpoint_seconds",
]


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_exporter_serves_every_metric():
    metrics = NodeMetrics()
    metrics.set_info(peer_id="12D3KooWtest", run_id="run-1", version="0.1.0")
    metrics.rounds.inc()
    metrics.round.set(1)
    metrics.rounds_aborted.labels(reason="timeout").inc()
    metrics.rejected_messages.labels(reason="bad_size").inc(2)
    metrics.allreduce_seconds.observe(1.5)
    metrics.start("127.0.0.1:0")
    try:
        port = metrics.bound_port
        assert port and port > 0
        text = fetch(port)
    finally:
        metrics.close()
    for name in METRIC_NAMES:
        assert f"# HELP {name} " in text, name
        assert f"# TYPE {name} " in text, name
    assert 'gonka_node_info{peer_id="12D3KooWtest",run_id="run-1",version="0.1.0"} 1.0' in text
    assert "gonka_node_rounds_total 1.0" in text
    assert 'gonka_node_rounds_aborted_total{reason="timeout"} 1.0' in text
    assert 'gonka_node_rejected_messages_total{reason="bad_size"} 2.0' in text
    assert 'gonka_node_allreduce_seconds_bucket{le="600.0"} 1.0' in text
    assert "gonka_node_round 1.0" in metrics.render().decode()


def test_close_frees_the_port():
    metrics = NodeMetrics()
    metrics.start("127.0.0.1:0")
    port = metrics.bound_port
    metrics.close()
    assert metrics.bound_port is None
    with pytest.raises(OSError):
        fetch(port)
    # The port can be bound again at once.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    metrics.close()  # idempotent


def test_registries_are_private_and_off_serves_nothing():
    a, b = NodeMetrics(), NodeMetrics()
    a.rounds.inc(5)
    assert "gonka_node_rounds_total 0.0" in b.render().decode()
    a.start("off")
    assert a.bound_port is None


def test_busy_port_names_the_setting():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(RuntimeError, match="node.metrics_addr: cannot listen on"):
            NodeMetrics().start(f"127.0.0.1:{port}")


def test_label_values_a_peer_chose_are_counted_as_other():
    metrics = NodeMetrics()
    # As a peer's reply reaches the metrics: RoundFailed(str(header.get("reason"))[:40]).
    hostile = ['x" } evil_total 1e9', "a" * 40, "timeout ", "TIMEOUT", "", "\n", "other_reason_" + "z" * 20]
    for reason in hostile:
        for metric in (metrics.rejected_messages, metrics.averaging_failures, metrics.rounds_aborted, metrics.resyncs):
            metric.labels(reason=reason).inc()
    metrics.rounds_aborted.labels(reason=None).inc()  # not even a string
    metrics.state_downloads.labels(result="pwned").inc()
    metrics.averaging_failures.labels("timeout").inc()  # positional, as prometheus_client allows
    metrics.rejected_messages.labels(reason="stream_flood").inc()
    get = metrics.registry.get_sample_value
    for name in ("rejected_messages", "averaging_failures", "rounds_aborted", "resyncs"):
        samples = [s for m in metrics.registry.collect() if m.name == f"gonka_node_{name}" for s in m.samples
                   if s.name.endswith("_total")]
        assert {s.labels["reason"] for s in samples} <= REASONS | {OTHER}, name
    assert get("gonka_node_rejected_messages_total", {"reason": OTHER}) == len(hostile)
    assert get("gonka_node_rounds_aborted_total", {"reason": OTHER}) == len(hostile) + 1
    assert get("gonka_node_state_downloads_total", {"result": OTHER}) == 1
    assert get("gonka_node_averaging_failures_total", {"reason": "timeout"}) == 1
    assert get("gonka_node_rejected_messages_total", {"reason": "stream_flood"}) == 1
    assert "evil" not in metrics.render().decode()
    assert reason_label("bad_size") == "bad_size" and reason_label(["bad_size"]) == OTHER


# Where a reason label is born in the code: the literal in each of these is one.
REASON_SITES = [
    r'(?:RoundFailed|WireError|CodecError|RecordRefused|reject|_on_reject|fail|resync)\(\s*"([a-z0-9_]+)"',
    r'return False, "([a-z0-9_]+)"',  # refusals of pure decisions (quorum, certificates)
    r'"reason":\s*"([a-z0-9_]+)"',
    r'get\("reason",\s*"([a-z0-9_]+)"\)',
    r'getattr\(e,\s*"reason",\s*"([a-z0-9_]+)"\)',
    r'\breason=\s*"([a-z0-9_]+)"',
    r'\breason=[^,)]*\bor\s+"([a-z0-9_]+)"',
    r'\breason\s*=\s*(?:[^=\n]*\belse\s+)?"([a-z0-9_]+)"',
    r'RoundOutcome\("[a-z]+",\s*"([a-z0-9_]+)"',
    r'resync\([^)\n]*\belse\s+"([a-z0-9_]+)"\)',
    r'raise ValueError\("([a-z0-9]+_[a-z0-9_]+)"\)',  # parse_peer_record's reasons, counted by swarm.reject
]


def test_every_reason_in_the_code_is_in_the_fixed_set():
    found: dict[str, str] = {}
    for path in sorted([*ROOT.glob("p2p/*.py"), *ROOT.glob("node/*.py")]):
        if path.name == "hostile.py":  # what a hostile peer sends is meant to end up as "other"
            continue
        text = path.read_text()
        for pattern in REASON_SITES:
            for m in re.finditer(pattern, text):
                found.setdefault(m.group(1), f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}")
        if errors := re.search(r"ERRORS = \{([^}]*)\}", text):  # the C kernels' codec reasons
            for reason in re.findall(r'"([a-z0-9_]+)"', errors.group(1)):
                found.setdefault(reason, str(path.relative_to(ROOT)))
    assert len(found) > 40  # the scan still finds the reasons
    missing = {reason: where for reason, where in found.items() if reason not in REASONS}
    assert not missing, f"add these to node.metrics.REASONS (or stop using them as labels): {missing}"
