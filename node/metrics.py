"""Prometheus metrics of one node, and the HTTP endpoint that serves them.

Every number an operator would put on a dashboard is defined here, once, with
its help string: that text is what users read in Prometheus and Grafana. The
metrics live in a private registry, so several nodes (or tests) in one
process never share counters. Label values come from fixed sets defined here:
a reason can travel in a peer's message, and a peer must not be able to name
new time series (``LabelledMetric``).
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest, start_http_server

from node.config import parse_host_port
from p2p.ledger import FLAGS

# A round's network phases range from a LAN all-reduce of a tiny model
# (~10 ms) to a cross-continent transfer of a large one (minutes).
NETWORK_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 600)
# One inner step: milliseconds for the tiny CPU model, seconds on big models.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A joiner's full state download: model and optimizer state of up to GBs.
DOWNLOAD_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 600, 1800)
# Writing a checkpoint (with fsync) to local disk.
CHECKPOINT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 300)

# Every value the ``reason`` label of rejected_messages, averaging_failures,
# rounds_aborted and resyncs may take; any other is recorded as OTHER. A reason
# used in the code must be listed here (tests/unit/test_metrics.py checks).
REASONS = frozenset({
    # frames on the wire (p2p/wire.py, p2p/limits.py)
    "oversized_header", "oversized_payload", "truncated", "timeout", "bad_header", "bad_field",
    "write_timeout", "handler_timeout", "stream_flood", "connection_lost", "unreachable", "handler_error", "error",
    # the round protocol and its groups (p2p/rounds.py, p2p/exchange.py, p2p/group.py)
    "swarm_ahead", "stopping", "member_refused", "digest_mismatch", "unknown_group", "not_a_member",
    "bad_members", "not_waiting", "bad_size", "codec_mismatch", "aborted_by_peer", "peer_failed", "unknown",
    "bad_payload", "non_finite", "duplicate_part", "bad_weight", "bad_lane", "bad_average", "bad_vote",
    # codecs (p2p/codecs.py, p2p/sparsecodec.py, p2p/native.py)
    "non_finite_input", "non_finite_value", "non_finite_scale", "negative_scale", "scale_overflow", "bad_code",
    "bad_padding", "bad_index",
    # state transfer (p2p/transfer.py)
    "not_in_swarm", "no_state", "moved_on", "bad_range", "bad_op", "refused", "bad_state_meta", "bad_state_chunk",
    "bad_average", "bad_average_meta", "no_average", "too_many_pieces",
    # the peer table (p2p/swarm.py)
    "bad_peer_table", "bad_peer_id", "bad_heartbeat", "bad_heartbeat_state", "bad_heartbeat_round",
    "bad_heartbeat_hash", "bad_heartbeat_step", "bad_heartbeat_round_tokens", "bad_heartbeat_loss",
    "bad_heartbeat_maddrs", "bad_heartbeat_fingerprint", "bad_heartbeat_observed", "bad_heartbeat_dial",
    "fingerprint_mismatch",
    "peer_table_full",
    # trust: closed swarms, owner-bound records, certificates, bounded influence, quarantine
    "not_admitted", "weight_capped", "audit_failed", "owner_misreported", "bad_certificate", "bad_entry", "bad_check", "bad_checks", "not_checker", "not_declared", "not_ready", "quarantined",
    "uncertified_state", "no_quorum", "state_mismatch", "bad_evidence", "no_certificate", "certificate_without_quorum", "chain_breaks", "hostile",
    "aborted", "aborted_again", "silent_leader", "shunned",
    "record_malformed", "record_other_key", "record_plain_value", "record_oversized", "record_unsigned",
    "record_foreign_key", "record_far_expiry", "record_bad_signature",
    # the ranks of a multi-rank host (node/ranks.py)
    "rank_lost", "shard_failed",
    # why a node re-synced (node/loop.py)
    "join", "behind", "diverged",
})
# What state_downloads{result} may say.
RESULTS = frozenset({"ok", "failed", "uncertified"})
OTHER = "other"


def reason_label(value: object) -> str:
    """``value`` if it is one of REASONS, else OTHER: what a peer sent never becomes a label of its own."""
    return value if isinstance(value, str) and value in REASONS else OTHER


class LabelledMetric:
    """A labelled metric whose label values come from fixed sets, each value outside its
    set recorded as OTHER. ``labels`` is all callers use; the rest passes through."""

    __slots__ = ("metric", "allowed")

    def __init__(self, kind, name: str, documentation: str, *, registry: CollectorRegistry,
                 **allowed: frozenset[str]) -> None:
        """``kind`` (Counter, Gauge) named ``name``, one label per keyword, with its allowed values."""
        self.metric = kind(name, documentation, list(allowed), registry=registry)
        self.allowed = allowed

    def labels(self, *values: object, **named: object):
        if values:
            assert not named and len(values) == len(self.allowed)
            named = dict(zip(self.allowed, values))
        return self.metric.labels(**{label: value if isinstance(value, str) and value in self.allowed[label] else OTHER
                                     for label, value in named.items()})

    def __getattr__(self, name: str):
        return getattr(self.metric, name)


class NodeMetrics:
    """The node's metrics; the daemon updates the attributes, Prometheus scrapes them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.info = Info("gonka_node", "Identity of this node: libp2p peer id, run id, software version.", registry=r)

        # Training progress.
        self.rounds = Counter("gonka_node_rounds_total", "Outer rounds committed by this node.", registry=r)
        self.round = Gauge("gonka_node_round", "Number of the last outer round this node committed.", registry=r)
        self.rounds_aborted = LabelledMetric(
            Counter,
            "gonka_node_rounds_aborted_total",
            "Outer rounds abandoned without a commit, by reason (\"other\": none of the known ones); the inner steps "
            "are kept for the next round.",
            registry=r,
            reason=REASONS,
        )
        # The ledger (p2p/ledger.py): what this node's committed rounds said of their members.
        self.ledger_flags = LabelledMetric(
            Counter, "gonka_node_ledger_flags_total",
            "Members flagged in the ledger entries of the rounds this node committed, by flag (p2p/ledger.py).",
            registry=r, flag=frozenset(FLAGS))
        self.credit = Counter("gonka_node_credit_tokens_total",
                              "Tokens credited to this node in the ledger entries of the rounds it committed.",
                              registry=r)
        self.checks = LabelledMetric(
            Counter, "gonka_node_checks_total",
            "Checks this node made of sampled members' updates (p2p/checks.py), by verdict (ok, or the flags).",
            registry=r, verdict=frozenset(["ok", "unassigned", "withheld"]))
        self.scoring_seconds = LabelledMetric(
            Counter, "gonka_node_scoring_seconds_total",
            "Seconds spent scoring contributions: Gram matrices of owned pieces, ledger entries, checks "
            "(fetch and forward passes).", registry=r, part=frozenset(["gram", "entry", "check"]))
        self.standing = Gauge("gonka_node_standing",
                              "Share of this node's tokens the next average counts (1, 0.25 after a flagged round, "
                              "0: left out).", registry=r)
        self.inner_steps = Counter("gonka_node_inner_steps_total", "Local inner optimizer steps taken.", registry=r)
        self.tokens = Counter("gonka_node_tokens_total", "Training tokens processed by this node's inner steps.", registry=r)
        self.loss = Gauge("gonka_node_loss", "Mean training loss over the inner steps of the last round.", registry=r)
        self.eval_loss = Gauge("gonka_node_eval_loss", "Loss on the held-out evaluation batches, last measured.", registry=r)
        self.inner_step_seconds = Histogram(
            "gonka_node_inner_step_seconds",
            "Mean wall time of an inner step (forward, backward, optimizer), observed once per round.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.train_seconds = Counter(
            "gonka_node_train_seconds_total",
            "Wall time spent in inner steps (divide by wall time for compute utilization).",
            registry=r,
        )

        # The swarm and the rounds' network phases.
        self.overlap_wait_seconds = Counter(
            "gonka_node_overlap_wait_seconds_total",
            "Overlapped rounds: seconds the inner steps waited for the previous round's average.",
            registry=r,
        )
        self.peers = Gauge("gonka_node_peers", "Live swarm peers known to this node, itself included.", registry=r)
        self.reachable = Gauge("gonka_node_reachable", "1 if other peers can dial this node (most of those asked "
                               "dialled it back), 0 if not (behind NAT or a firewall), -1 until they answered.",
                               registry=r)
        self.reachable.set(-1)
        self.round_members = Gauge(
            "gonka_node_round_members", "Peers that took part in the last round's all-reduce, this node included.", registry=r
        )
        self.allreduce_seconds = Histogram(
            "gonka_node_allreduce_seconds",
            "Wall time of one round's all-reduce of pseudo-gradients, commit vote included.",
            buckets=NETWORK_BUCKETS,
            registry=r,
        )
        self.gather_wait_seconds = Histogram(
            "gonka_node_gather_wait_seconds",
            "Time this node waited, ready, for the other peers to finish their inner steps.",
            buckets=NETWORK_BUCKETS,
            registry=r,
        )
        self.sent_bytes = Counter("gonka_node_sent_bytes_total", "Bytes sent to other peers: rounds and state served to joiners.", registry=r)
        self.received_bytes = Counter(
            "gonka_node_received_bytes_total", "Bytes received from other peers: rounds and state downloads.", registry=r
        )
        self.averaging_failures = LabelledMetric(
            Counter, "gonka_node_averaging_failures_total", "All-reduce attempts that failed, by reason (\"other\": none of the known ones).",
            registry=r, reason=REASONS,
        )
        self.rejected_messages = LabelledMetric(
            Counter,
            "gonka_node_rejected_messages_total",
            "Messages from other peers rejected as invalid, by reason (\"other\": none of the known ones); none of "
            "them reached the model.",
            registry=r,
            reason=REASONS,
        )

        self.quarantined = LabelledMetric(
            Counter,
            "gonka_node_quarantined_total",
            "Peers this node left out of its rounds for swarm.quarantine_seconds, by what they did: a lie "
            "(bad input, a failed audit, a capped weight) at once, aborts, refusals or a silent lead after "
            "3 strikes.",
            registry=r,
            reason=REASONS,
        )
        self.quarantined_peers = Gauge("gonka_node_quarantined_peers", "Peers this node keeps out of its rounds now.",
                                       registry=r)

        # Joining, resynchronising and serving state.
        self.state_downloads = LabelledMetric(
            Counter,
            "gonka_node_state_downloads_total",
            "Downloads of the training state from another peer, by result (uncertified: no certificate chain "
            "from a trusted state led to it, nothing downloaded).",
            registry=r,
            result=RESULTS,
        )
        self.caught_up_rounds = Counter(
            "gonka_node_caught_up_rounds_total",
            "Rounds the swarm committed during a state download that this node then took from their "
            "averages (p2p/averagelog.py) instead of downloading the state again.",
            registry=r,
        )
        self.state_download_seconds = Histogram(
            "gonka_node_state_download_seconds",
            "Wall time of one training state download from another peer.",
            buckets=DOWNLOAD_BUCKETS,
            registry=r,
        )
        self.state_served = Counter(
            "gonka_node_state_served_total", "Training state transfers this node served to joining peers.", registry=r
        )
        self.round_retries = Counter(
            "gonka_node_round_retries_total",
            "Round attempts this node retried after an aborted attempt (same pseudo-gradient, surviving peers).",
            registry=r,
        )
        self.stragglers_excluded = Counter(
            "gonka_node_stragglers_excluded_total",
            "Peers still in their inner steps when this node, leading a round, started it without them.",
            registry=r,
        )
        self.resyncs = LabelledMetric(
            Counter,
            "gonka_node_resyncs_total",
            "Times this node replaced its state with the swarm's because it had diverged or fallen behind, by reason.",
            registry=r,
            reason=REASONS,
        )

        # Checkpoints.
        self.checkpoints = Counter("gonka_node_checkpoints_total", "Checkpoints written to disk.", registry=r)
        self.checkpoint_failures = Counter(
            "gonka_node_checkpoint_failures_total",
            "Checkpoints that could not be written (a full disk, say): the node trains on, the previous "
            "checkpoint stays in use, the next commit tries again.", registry=r)
        self.min_peers = Gauge("gonka_node_min_peers", "The run's --min-peers: no round commits with fewer "
                               "members (a strict majority of the live peers is needed as well).", registry=r)
        self.checkpoint_seconds = Histogram(
            "gonka_node_checkpoint_seconds",
            "Wall time of writing one checkpoint, fsync included.",
            buckets=CHECKPOINT_BUCKETS,
            registry=r,
        )

        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def set_info(self, peer_id: str, run_id: str, version: str) -> None:
        self.info.info({"peer_id": peer_id, "run_id": run_id, "version": version})

    def start(self, addr: str) -> None:
        """Serve /metrics on "HOST:PORT" from a daemon thread; "off" serves nothing."""
        if addr == "off":
            return
        if self._server is not None:
            raise RuntimeError("metrics exporter already started")
        host, port = parse_host_port(addr)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise RuntimeError(f"node.metrics_addr: cannot listen on {addr}: {exc.strerror or exc}") from None

    @property
    def bound_port(self) -> int | None:
        """The port actually listened on (the real one when port 0 was asked), None when not serving."""
        return None if self._server is None else self._server.server_port

    def close(self) -> None:
        if self._server is None:
            return
        server, thread = self._server, self._thread
        self._server = self._thread = None
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def add_rank_counts(self, counts: dict) -> None:
        """What another rank's shard plane counted (node/ranks.py): a multi-rank host's metrics
        cover every rank."""
        self.sent_bytes.inc(max(0.0, float(counts.get("sent", 0.0))))
        self.received_bytes.inc(max(0.0, float(counts.get("received", 0.0))))
        self.state_served.inc(max(0.0, float(counts.get("served", 0.0))))
        for reason, n in dict(counts.get("rejected", {})).items():
            self.rejected_messages.labels(reason=str(reason)[:40]).inc(max(0, int(n)))

    def counted(self, name: str, by: str | None = None) -> float | dict[str, float]:
        """A counter's total over its labels, or (``by``) its value per label value."""
        per: dict[str, float] = {}
        for metric in self.registry.collect():
            for sample in metric.samples:
                if sample.name == name:
                    key = sample.labels.get(by, "") if by else ""
                    per[key] = per.get(key, 0.0) + sample.value
        return per if by else sum(per.values())

    def render(self) -> bytes:
        """The exposition text a scrape would get."""
        return generate_latest(self.registry)
