"""One line per committed round, kept next to the checkpoints: what an operator plots.

``history.jsonl`` in the checkpoint directory: each committed round appends one
JSON object (``FIELDS``) as one ``write`` on a file opened for appending, so a
crash can at worst cut the last line short; ``read`` skips a line it cannot
parse and any record without the fields, so a damaged line never stops a plot.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

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
