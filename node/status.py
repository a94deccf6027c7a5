"""The node's status object: what `gonka-node status --json` prints and `--status-file` holds."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from trainer.files import atomic_write


@dataclass(slots=True)
class Status:
    peer_id: str = ""
    run_id: str = ""
    version: str = ""
    # joining | training | ready (waiting for the others) | averaging | stopped
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
    # Whether other peers can dial this node (p2p/reachability.py); None until peers have answered.
    reachable: bool | None = None
    started_at: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        return asdict(self)


def write_status_file(path: str, status: Status) -> None:
    """Readers (monitoring, tests) never see half a file."""
    text = json.dumps(status.to_json(), indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
