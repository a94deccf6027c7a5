"""The Prometheus exporter serves every metric the dashboards rely on."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from node.metrics import NodeMetrics

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
    metrics.rejected_messages.labels(reason="bad_shape").inc(2)
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
    assert 'gonka_node_rejected_messages_total{reason="bad_shape"} 2.0' in text
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
