"""One fingerprint per run: everything that must be equal on every peer, hashed.

Peers of one run id average their pseudo-gradients and follow each other's
state, which only makes sense if they train the same thing. The fingerprint
covers what decides θ: the model config, the initial parameters, the
tokenizer, the data (the manifest, or the byte corpus and its held-out
split), the sequence length, the wire codec, the outer settings and the
protocol version. It scopes the swarm: peers announce it in their heartbeats
and name their protocols after it, so a peer started with another ``--model``
is never counted, waited for or followed; both sides refuse it with one line
that says which part differs.

Each part is announced as a short digest (or its value, when that is short and
readable, such as the codec), so a difference can be named without trusting
the peer for anything more than its own claim about itself.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

# Bumped whenever peers of two versions could not train together.
PROTOCOL_VERSION = 3

# What a part is called in messages to the user, in the order they are checked.
PART_NAMES = {
    "protocol": "protocol version",
    "model": "model config",
    "init": "initial parameters",
    "tokenizer": "tokenizer",
    "data": "data",
    "seq_len": "sequence length",
    "codec": "codec",
    "outer": "outer settings",
    "rounds": "round rules (aggregator, weight cap)",
    "layout": "host shard layout (host.nproc_per_node, host.parallel)",
}
MAX_PART_CHARS = 64

# Config keys that say nothing about the model's function: where it was loaded
# from, which transformers wrote it, how it is run.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache",
                         "output_attentions", "output_hidden_states", "return_dict", "_attn_implementation",
                         "attn_implementation", "_commit_hash", "tie_encoder_decoder"}


def _short(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def config_digest(config: dict) -> str:
    """Digest of a Hugging Face config dict without its volatile keys (canonical JSON)."""
    kept = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")}
    return _short(json.dumps(kept, sort_keys=True, default=str))


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """The run's parts (name -> short text) and one digest over all of them."""

    parts: dict[str, str]

    @property
    def digest(self) -> str:
        return hashlib.blake2b(json.dumps(self.parts, sort_keys=True).encode(), digest_size=16).hexdigest()

    def difference(self, theirs: dict[str, str] | None) -> str:
        """What differs between this run and a peer's announced parts, as one phrase."""
        if not theirs:
            return "it announces no run fingerprint (another version of gonka-node?)"
        differ = []
        for key, name in PART_NAMES.items():
            mine, other = self.parts.get(key), theirs.get(key)
            if mine != other:
                differ.append(f"different {name} (this node {mine or '-'}, peer {other or '-'})")
        unknown = sorted(set(theirs) - set(PART_NAMES))
        if unknown:
            differ.append(f"unknown parts {', '.join(unknown[:3])}")
        return "; ".join(differ) or "same parts, another digest"


def run_fingerprint(*, model_config: dict, init_hash: str, tokenizer: str, data: str, seq_len: int, codec: str,
                    outer_lr: float, outer_momentum: float, nesterov: bool, rounds: str = "",
                    layout: str = "") -> Fingerprint:
    """The fingerprint of a run from its parts (each already a digest or a short value)."""
    parts = {
        "protocol": str(PROTOCOL_VERSION),
        "model": config_digest(model_config),
        "init": init_hash[:16],
        "tokenizer": tokenizer[:16],
        "data": data[:16],
        "seq_len": str(seq_len),
        "codec": codec,
        "outer": f"lr={outer_lr!r},momentum={outer_momentum!r},nesterov={str(bool(nesterov)).lower()}",
    }
    if rounds:  # how owners combine and cap contributions: every auditor must recompute the same
        parts["rounds"] = rounds[:MAX_PART_CHARS]
    if layout:  # a multi-rank host's shards (trainer/parallel.py): rank k syncs with rank k of every host
        parts["layout"] = layout[:MAX_PART_CHARS]
    return Fingerprint(parts)


def parse_parts(value) -> dict[str, str] | None:
    """A peer's announced parts, validated (bounded size, text only); None if malformed."""
    if not isinstance(value, dict) or len(value) > 2 * len(PART_NAMES):
        return None
    if not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 32 and len(v) <= MAX_PART_CHARS
               for k, v in value.items()):
        return None
    return dict(value)
