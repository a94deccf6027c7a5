"""The hash of θ as loaded, once per set of weight files (``DiLoCoWorker.init_hash``).

A start hashes θ for the run's fingerprint and its genesis (blake2b, ~1 GB/s: 35 s per rank of a
70B model on 8 ranks, every start). θ read from pretrained safetensors files is a function of
those files, the model's config and the shard a rank holds: its hash is kept in a small cache
keyed by each file's path, size and modification time (ns), the layout and rank, and the torch
version, and a start with the same files reads it back instead. A random init is always hashed
(it is a function of the code as much as of the seed). Changing a file changes its size or
mtime, and so the key; ``GONKA_CACHE_DIR=DIR`` moves the cache, deleting it forces a hash.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Callable

from trainer.files import atomic_write

log = logging.getLogger(__name__)
CACHE_FILE = "init-hashes.json"
MAX_ENTRIES = 64


def cache_dir() -> str:
    explicit = os.environ.get("GONKA_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gonka-node")


def cache_key(files: tuple[str, ...], layout: str) -> str | None:
    """The key of θ read from ``files`` into ``layout`` (a rank's shard), None if a file is gone."""
    import torch

    entries = []
    for path in files:
        try:
            st = os.stat(path)
        except OSError:
            return None
        entries.append([os.path.realpath(path), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"files": sorted(entries), "layout": layout, "torch": torch.__version__, "v": 1})
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def _read(path: str) -> dict[str, str]:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str) and len(v) == 32}


def init_hash(files: tuple[str, ...], layout: str, compute: Callable[[], str]) -> str:
    """``compute()`` (the hash of θ), or what it gave for the same files and layout before."""
    key = cache_key(files, layout) if files else None
    if key is None:
        return compute()
    path = os.path.join(cache_dir(), CACHE_FILE)
    cached = _read(path)
    if key in cached:
        return cached[key]
    digest = compute()
    cached = _read(path)  # another rank or node may have written meanwhile
    cached.pop(key, None)
    cached[key] = digest
    keep = dict(list(cached.items())[-MAX_ENTRIES:])
    try:
        atomic_write(path, lambda f: f.write(json.dumps(keep).encode()))
    except OSError as e:  # a cache: a start that cannot write it hashes again next time
        log.warning("cannot write the init hash cache %s: %s", path, e.strerror or e)
    return digest
