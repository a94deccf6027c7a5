"""Crash-safe checkpoints: a complete ``latest.pt`` or the previous one, never half of one.

The state is written to a temporary file in the same directory, flushed and
fsynced, renamed over ``latest.pt`` (atomic on POSIX), and the directory is
fsynced so the rename itself survives a power cut. Loading uses
``weights_only=True``: a checkpoint file is input and must not run code.
"""

from __future__ import annotations

import os

import torch

from trainer.files import atomic_write

LATEST = "latest.pt"


def save_checkpoint(directory: str, state: dict) -> str:
    """Atomically write ``state`` to ``directory/latest.pt``; returns that path."""
    path = os.path.join(directory, LATEST)
    atomic_write(path, lambda f: torch.save(state, f))
    return path


def load_error(error: Exception) -> str:
    """One line saying what broke; torch's weights-only errors are a page of advice
    (including "retry with weights_only=False", exactly what must not be done here)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        detail = [
            line.split("WeightsUnpickler error:")[-1].strip()
            for line in lines[1:]
            if not line.startswith("Check the documentation")
        ]
        detail = [d for d in detail if d]
        return "not a checkpoint of plain tensors and containers" + (f" ({detail[0]})" if detail else "")
    return f"{type(error).__name__}: {lines[0]}" if lines else f"{type(error).__name__} (truncated or empty file?)"


def load_checkpoint(directory: str) -> dict | None:
    """The state in ``directory/latest.pt``, or None when there is none yet."""
    path = os.path.join(directory, LATEST)
    if not os.path.exists(path):
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"node.checkpoint_dir: cannot load {path}: {load_error(e)}") from e
    if not isinstance(state, dict):
        raise ValueError(f"node.checkpoint_dir: cannot load {path}: not a checkpoint (got {type(state).__name__})")
    return state
