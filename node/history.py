"""One line per committed round, kept next to the checkpoints: what an operator plots.

``history.jsonl`` in the checkpoint directory: each committed round appends one
JSON object (``FIELDS``) as one ``write`` on a file opened for appending, so a
crash can at worst cut the last line short; ``read`` skips a line it cannot
parse and any record without the fields, so a damaged line never stops a plot.
``RoundRecorder`` is the node's writer: after each commit, the round's line here and
what the node's heartbeat tells the others of it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

log = logging.getLogger("gonka.node")

FILE_NAME = "history.jsonl"
# round: the committed round; time: unix seconds of the commit; loss: this node's mean training
# loss over the round's inner steps; eval_loss: held-out loss of the global parameters (None if
# not evaluated at that round); tokens: tokens this node trained on for the round; members: the
# round's members; allreduce_s: seconds from the group's start to the commit; sent_bytes and
# received_bytes: bytes this node sent and received in the round (averaging and state served);
# params_hash: the global parameters after the round.
FIELDS = ("round", "time", "loss", "eval_loss", "tokens", "members", "allreduce_s", "sent_bytes",
          "received_bytes", "params_hash")


def path_in(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, FILE_NAME)


def append(checkpoint_dir: str, record: dict[str, Any]) -> None:
    """Append one round's record (the keys of ``FIELDS``; non-finite numbers become null)."""
    line = json.dumps({k: _finite(record.get(k)) for k in FIELDS}, separators=(",", ":")) + "\n"
    os.makedirs(checkpoint_dir, exist_ok=True)
    fd = os.open(path_in(checkpoint_dir), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class RoundRecorder:
    """The round a node just committed: one line in DIR/history.jsonl (DIR: node.checkpoint_dir,
    "" writes none) and what its heartbeat says of it (p2p/peertable.py ``OBSERVED``, for `top`
    elsewhere). The training loop's record of the commit gains the bytes this node sent and
    received since the last one, read from its metrics (node/metrics.py)."""

    def __init__(self, checkpoint_dir: str, metrics) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.metrics = metrics
        self._bytes_at_commit = (0.0, 0.0)  # sent and received byte counters at the last commit

    def record(self, loop) -> None:
        """Record the training loop's (node/loop.py) last commit, if it has one."""
        record = loop.last_commit
        if record is None:
            return
        sent, received = (self.metrics.registry.get_sample_value(f"gonka_node_{name}_bytes_total") or 0.0
                          for name in ("sent", "received"))
        record = dict(record, sent_bytes=int(sent - self._bytes_at_commit[0]),
                      received_bytes=int(received - self._bytes_at_commit[1]))
        self._bytes_at_commit = (sent, received)
        loop.swarm.announce(obs=self.observed(record, loop.rounds.last.gather_seconds))
        if not self.checkpoint_dir:
            return
        try:
            append(self.checkpoint_dir, record)
        except OSError as e:  # a full disk costs the line, not the node
            log.warning("cannot append to the round history: %s", e)

    def observed(self, record: dict, gather_seconds: float) -> dict:
        """What the heartbeat tells of the round: all-reduce and gather seconds, bandwidth, this
        node's aborts and rejections so far, and the eval loss if measured."""
        seconds = record.get("allreduce_s") or 0.0
        obs = {"ar": seconds, "gw": gather_seconds,
               "bw": (record["sent_bytes"] + record["received_bytes"]) / seconds if seconds > 0 else 0.0,
               "ab": self.metrics.counted("gonka_node_rounds_aborted_total"),
               "rj": self.metrics.counted("gonka_node_rejected_messages_total")}
        if record.get("eval_loss") is not None:
            obs["el"] = record["eval_loss"]
        return {k: round(float(v), 6) for k, v in obs.items() if math.isfinite(v) and v >= 0}


def read(path: str) -> list[dict[str, Any]]:
    """Every well-formed record of a history file, in file order (later rounds win on repeats:
    a node that re-synced back to an earlier round commits it again)."""
    by_round: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("round"), int) and \
                    isinstance(record.get("time"), (int, float)):
                by_round[record["round"]] = record
    return [by_round[r] for r in sorted(by_round)]


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
