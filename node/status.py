"""The node's status object: what `gonka-node status --json` prints and `--status-file` holds."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class Status:
    peer_id: str = ""
    run_id: str = ""
    version: str = ""
    # joining | training | averaging | stopped
    state: str = "joining"
    # Committed outer rounds of the global state this node holds.
    round: int = 0
    # Inner steps this node has run in total.
    inner_step: int = 0
    # Mean training loss over the inner steps of the last round.
    loss: float | None = None
    # Loss of the global parameters on the held-out split, after the last commit.
    eval_loss: float | None = None
    # Live swarm peers known, this node included.
    peers: int = 1
    # Hex digest of the global parameters; equal on peers holding equal parameters.
    params_hash: str = ""
    # This node's addresses, usable as --bootstrap by others.
    multiaddrs: list[str] = field(default_factory=list)
    # Members of the last committed round.
    last_round_members: int = 0
    started_at: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        return asdict(self)


def write_atomically(path: str, text: str) -> None:
    """Temporary file in the same directory, fsync, rename: readers never see half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".status-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_status_file(path: str, status: Status) -> None:
    write_atomically(path, json.dumps(status.to_json(), indent=2, sort_keys=True) + "\n")
