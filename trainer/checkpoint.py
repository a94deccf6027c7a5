"""Crash-safe checkpoints: a complete ``latest.pt`` or the previous one, never half of one.

The state is written to a temporary file in the same directory, flushed and
fsynced, renamed over ``latest.pt`` (atomic on POSIX), and the directory is
fsynced so the rename itself survives a power cut. Loading uses
``weights_only=True``: a checkpoint file is input and must not run code.
"""

from __future__ import annotations

import os
import tempfile

import torch

LATEST = "latest.pt"


def save_checkpoint(directory: str, state: dict) -> str:
    """Atomically write ``state`` to ``directory/latest.pt``; returns that path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LATEST)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".latest.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load_checkpoint(directory: str) -> dict | None:
    """The state in ``directory/latest.pt``, or None when there is none yet."""
    path = os.path.join(directory, LATEST)
    if not os.path.exists(path):
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        # torch's unpickling errors run to many lines; the first one says what broke.
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"node.checkpoint_dir: cannot load {path}: {reason}") from e
    if not isinstance(state, dict):
        raise ValueError(f"node.checkpoint_dir: cannot load {path}: not a checkpoint (got {type(state).__name__})")
    return state
