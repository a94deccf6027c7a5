"""Names of the sparse codec's variants (``swarm.codec = sparse...``), without torch.

A name carries every setting of the format, so peers that agree on a name agree on the bytes
(the name is part of the run's fingerprint). ``sparse`` alone is the default; each setting that
differs from it is a ``-<key><number>`` suffix, in this order:

- ``c``: values per chunk, a power of two from 64 to 65536 (default 4096); an index takes
  log2(chunk) bits.
- ``k``: values each member keeps per chunk (default 64: 1.56%).
- ``b``: bits per kept value, 2 to 8 (default 2).
- ``ak``: values the owner keeps per chunk of the averaged part (default twice ``k``, at
  most the chunk).
- ``ab``: bits per kept value of the averaged part (default 4).

``sparse-k128`` keeps 3.1%; ``sparse-k32-b3`` keeps 0.78% at 3 bits. ``canonical`` writes the
defaults out of a name, so ``sparse-c4096`` and ``sparse`` are one codec, named ``sparse``.
"""

from __future__ import annotations

import re

DEFAULTS = {"c": 4096, "k": 64, "b": 2, "ak": 0, "ab": 4}  # ak 0: twice k, at most the chunk
_PART = re.compile(r"-(ak|ab|c|k|b)(\d{1,6})")


def parse(name: str) -> dict[str, int] | None:
    """The settings of a sparse codec's name; None if ``name`` is not one. ValueError says what
    is wrong with a name that starts with ``sparse`` but is not valid."""
    if not isinstance(name, str) or not (name == "sparse" or name.startswith("sparse-")):
        return None
    settings, rest, seen = dict(DEFAULTS), name[len("sparse"):], []
    while rest:
        match = _PART.match(rest)
        if match is None:
            raise ValueError(f"cannot read {rest!r} in sparse codec name {name!r} (keys: -c -k -b -ak -ab)")
        key = match.group(1)
        if key in seen or (seen and list(DEFAULTS).index(key) < list(DEFAULTS).index(seen[-1])):
            raise ValueError(f"sparse codec name {name!r}: each of -c -k -b -ak -ab once, in that order")
        seen.append(key)
        settings[key] = int(match.group(2))
        rest = rest[match.end():]
    chunk = settings["c"]
    if "ak" not in seen:
        settings["ak"] = min(2 * settings["k"], chunk)
    if chunk < 64 or chunk > 65536 or chunk & (chunk - 1):
        raise ValueError(f"sparse codec name {name!r}: chunk must be a power of two from 64 to 65536")
    for key in ("k", "ak"):
        if not 1 <= settings[key] <= chunk:
            raise ValueError(f"sparse codec name {name!r}: {key} must be between 1 and the chunk ({chunk})")
    for key in ("b", "ab"):
        if not 2 <= settings[key] <= 8:
            raise ValueError(f"sparse codec name {name!r}: {key} must be between 2 and 8 bits")
    return settings


def canonical(settings: dict[str, int]) -> str:
    """The name of these settings: ``sparse`` and each setting that is not the default."""
    default = dict(DEFAULTS, ak=min(2 * settings["k"], settings["c"]))
    return "sparse" + "".join(f"-{key}{settings[key]}" for key in DEFAULTS if settings[key] != default[key])
