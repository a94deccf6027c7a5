"""Configuration of the swarm: addresses, bootstrap, round timing.

Validated like every component config: a bad value raises ``ValueError``
starting with the dotted key (``swarm.listen: ...``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field

from p2p import sparsename
from trainer.config import require


_MULTIADDR = "p2p._multiaddr"  # the name hivemind's multiaddr package is loaded under


def _multiaddr_class():
    """hivemind's multiaddr parser (a package of its own, vendored in hivemind.utils), loaded on
    its own: through ``hivemind.utils`` it brings torch along, seconds before a bad address in a
    user's config can be named."""
    module = sys.modules.get(_MULTIADDR)
    if module is None:
        where = os.path.join(importlib.util.find_spec("hivemind").submodule_search_locations[0], "utils", "multiaddr")
        spec = importlib.util.spec_from_file_location(_MULTIADDR, os.path.join(where, "__init__.py"),
                                                      submodule_search_locations=[where])
        module = importlib.util.module_from_spec(spec)
        sys.modules[_MULTIADDR] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_MULTIADDR]
            raise
    return module.Multiaddr


def _is_multiaddr(text: str) -> bool:
    Multiaddr = _multiaddr_class()
    try:
        Multiaddr(text)
        return True
    except Exception:
        return False


def _is_peer_id(text: str) -> bool:
    from hivemind.p2p import PeerID

    try:
        return isinstance(text, str) and 20 <= len(text) <= 128 and PeerID.from_base58(text).to_base58() == text
    except Exception:
        return False


AGGREGATORS = ("mean", "clip", "centered_clip")
MIN_STATE_CHUNK_BYTES = 64 * 1024
# p2p/codecs.py's CODECS, by name (checked by tests/unit/test_codecs.py): without torch, which a
# config needs no more than a user waiting to hear that a value is wrong.
CODEC_NAMES = ("fp32", "fp16", "bf16", "int8", "int4", "fp4")


@dataclass(kw_only=True, slots=True)
class SwarmConfig:
    # Multiaddrs of running peers to join through (any live peer will do).
    # Empty: start a new swarm.
    bootstrap: list[str] = field(default_factory=list)
    # Multiaddrs to listen on. Loopback by default; on a real host use e.g.
    # /ip4/0.0.0.0/tcp/31337 and announce your public address.
    listen: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    # Multiaddrs other peers should dial (needs explicit ports). Empty: the
    # listen addresses as bound.
    announce: list[str] = field(default_factory=list)
    # Enables UPnP port mapping, AutoNAT and circuit relays in libp2p.
    # Off by default: the node only talks to the addresses it is given.
    nat_traversal: bool = False
    # A round commits only with a strict majority of the peers live at that
    # round (so two groups can never both commit it) and at least this many
    # members (this peer included); with fewer, peers keep waiting.
    min_peers: int = 1
    # Seconds a ready peer waits for the other live peers to finish their inner
    # steps before the round starts without them.
    gather_timeout: float = 60.0
    # Seconds allowed for the all-reduce and the commit vote of one round.
    round_timeout: float = 60.0
    # Seconds to wait for any single network call (connect, one message).
    request_timeout: float = 20.0
    # Codec of pseudo-gradients on the wire: fp32 (lossless), fp16, bf16, int8,
    # int4, fp4 (4-bit, FP4 E3M0) or sparse (top 64 of 4096 values at 2 bits;
    # variants such as sparse-k128: p2p/sparsename.py). Every peer of a run must
    # use the same one.
    codec: str = "fp32"
    # Add back next round what a lossy codec dropped (error feedback).
    error_feedback: bool = True
    # What error feedback keeps is multiplied by this at each commit (SparseLoCo's
    # beta: with outer.momentum = 0 the decayed residual takes the role of the
    # outer momentum); 1 keeps all of it.
    error_feedback_decay: float = 1.0
    # Size of the pieces a joining peer fetches from donors in parallel
    # (each verified on arrival); smaller spreads a small state over more donors.
    state_chunk_bytes: int = 4 * 1024 * 1024
    # Committed rounds whose averages this node keeps (as they came over the
    # wire: the codec's bytes per parameter each, in host RAM) so that a joiner
    # whose state download outlasts a round catches up from them instead of
    # downloading the state again; 0 keeps none.
    catchup_rounds: int = 4
    # Seconds between two announcements of this peer's state in the DHT;
    # a peer silent for 3 intervals is considered gone.
    heartbeat_interval: float = 2.0
    # ---- trust (docs/design.md, trust model) ----
    # Closed swarm: peer ids admitted to the run. With any of allow, allow_file
    # or authority set, every other peer is kept out of the DHT records,
    # routing tables, rounds and state of the run.
    allow: list[str] = field(default_factory=list)
    # File of admitted peer ids, one per line (# comments); re-read when it changes.
    allow_file: str = ""
    # Operator public key (from `gonka-node admit --new-authority`): peers with a
    # membership certificate it signed for this run and period are admitted.
    authority: str = ""
    # This node's membership certificate (`gonka-node admit`), for a swarm with an authority.
    member_cert: str = ""
    # How the owner of a part combines the members' pseudo-gradients: mean
    # (token-weighted), clip (each member's piece clipped to the median norm,
    # then the weighted mean) or centered_clip (CenteredClip iterations).
    aggregator: str = "clip"
    # Members sampled each round whose update two others check against its assigned data
    # (p2p/checks.py); 0: none. Each check fetches one member's encoded update and runs a few
    # forward passes; more catch a shirker sooner. Part of the run's fingerprint.
    checked_members: int = 2
    # Seconds a peer that aborted rounds, lied or failed checks is left out.
    quarantine_seconds: float = 300.0
    # Streams one peer may have open to this node at once (all protocols).
    max_streams_per_peer: int = 32

    def __post_init__(self) -> None:
        for key in ("bootstrap", "listen", "announce"):
            for addr in getattr(self, key):
                require(isinstance(addr, str) and _is_multiaddr(addr), f"swarm.{key}", f"not a multiaddr: {addr!r}")
        require(bool(self.listen), "swarm.listen", "needs at least one address")
        for addr in self.announce:
            require("/tcp/0/" not in addr + "/", "swarm.announce", f"needs an explicit port, not 0: {addr!r}")
        require(self.min_peers >= 1, "swarm.min_peers", f"must be >= 1 (got {self.min_peers})")
        try:
            sparse = sparsename.parse(self.codec)
        except ValueError as e:
            raise ValueError(f"swarm.codec: {e}") from None
        require(self.codec in CODEC_NAMES or sparse is not None, "swarm.codec",
                f"must be one of {', '.join(CODEC_NAMES)} or sparse[-c..][-k..][-b..][-ak..][-ab..] (got {self.codec!r})")
        require(0 < self.error_feedback_decay <= 1, "swarm.error_feedback_decay",
                f"must be in (0, 1] (got {self.error_feedback_decay})")
        require(MIN_STATE_CHUNK_BYTES <= self.state_chunk_bytes <= 64 * 1024 * 1024, "swarm.state_chunk_bytes",
                f"must be between 64 KiB and 64 MiB (got {self.state_chunk_bytes})")
        require(0 <= self.checked_members <= 1024, "swarm.checked_members",
                f"must be between 0 and 1024 (got {self.checked_members})")
        require(0 <= self.catchup_rounds <= 64, "swarm.catchup_rounds",
                f"must be between 0 and 64 (got {self.catchup_rounds})")
        require(self.aggregator in AGGREGATORS, "swarm.aggregator",
                f"must be one of {', '.join(AGGREGATORS)} (got {self.aggregator!r})")
        require(1 <= self.max_streams_per_peer <= 1024, "swarm.max_streams_per_peer",
                f"must be between 1 and 1024 (got {self.max_streams_per_peer})")
        for peer in self.allow:
            require(_is_peer_id(peer), "swarm.allow", f"not a peer id: {peer!r}")
        require(not self.member_cert or bool(self.authority), "swarm.member_cert",
                "needs swarm.authority (the key that signed it)")
        for key in ("gather_timeout", "round_timeout", "request_timeout", "heartbeat_interval", "quarantine_seconds"):
            value = getattr(self, key)
            require(value > 0, f"swarm.{key}", f"must be > 0 (got {value})")

    @property
    def closed(self) -> bool:
        """A closed swarm admits only listed or certified peers."""
        return bool(self.allow or self.allow_file or self.authority)
