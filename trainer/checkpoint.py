"""Crash-safe checkpoints: a complete ``latest.pt`` or the previous one, never half of one.

The state is written to a temporary file in the same directory, flushed and
fsynced, renamed over ``latest.pt`` (atomic on POSIX), and the directory is
fsynced so the rename itself survives a power cut. Loading uses
``weights_only=True``: a checkpoint file is input and must not run code.
"""

from __future__ import annotations

import os
import pickle

import torch

from trainer.files import atomic_write

LATEST = "latest.pt"


def save_checkpoint(directory: str, state: dict) -> str:
    """Atomically write ``state`` to ``directory/latest.pt``; returns that path."""
    path = os.path.join(directory, LATEST)
    atomic_write(path, lambda f: torch.save(state, f))
    return path


def load_tensors(path: str, **kwargs):
    """``torch.load(path, weights_only=True)``: plain tensors and containers, and the 8-bit AdamW
    state of torchao (``inner.optimizer_state = 8bit``), whose classes torchao allows for
    weights-only loading once imported (it is, only for a file that holds them)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        if "torchao." not in str(e):
            raise
    from trainer.memory import torchao_optim

    torchao_optim()
    return torch.load(path, map_location="cpu", weights_only=True, **kwargs)


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
        state = load_tensors(path)
    except Exception as e:
        raise ValueError(f"node.checkpoint_dir: cannot load {path}: {load_error(e)}") from e
    if not isinstance(state, dict):
        raise ValueError(f"node.checkpoint_dir: cannot load {path}: not a checkpoint (got {type(state).__name__})")
    return state


# ---- multi-rank hosts ---------------------------------------------------------------------
# One directory per checkpoint, ``host-SEQ/``, with one part per rank (``rank{k}.pt``: that
# rank's shards and its own optimizer, data and feedback state). Every rank writes its part
# atomically; only once all are written does rank 0 point ``latest-host.json`` at the
# directory (atomically) and remove the older ones. A crash mid-checkpoint leaves the pointer
# on the previous complete directory, which is still there.
HOST_LATEST = "latest-host.json"


def host_part_path(directory: str, seq: int, rank: int) -> str:
    return os.path.join(directory, f"host-{seq:010d}", f"rank{rank}.pt")


def save_host_part(directory: str, seq: int, rank: int, state: dict) -> str:
    """Atomically write rank ``rank``'s part of checkpoint ``seq``; returns its path."""
    path = host_part_path(directory, seq, rank)
    atomic_write(path, lambda f: torch.save({**state, "rank": rank, "seq": seq}, f))
    return path


def commit_host_checkpoint(directory: str, seq: int, world: int, round: int) -> None:
    """Every part of ``seq`` is written: make it the one a restart loads, drop the others."""
    import json
    import shutil

    pointer = {"seq": seq, "world": world, "round": round}
    atomic_write(os.path.join(directory, HOST_LATEST), lambda f: f.write(json.dumps(pointer).encode()))
    keep = f"host-{seq:010d}"
    for name in os.listdir(directory):
        if name.startswith("host-") and name != keep:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def host_checkpoint(directory: str, world: int) -> dict | None:
    """The complete checkpoint a host of ``world`` ranks resumes from ({seq, world, round}),
    None if there is none; ValueError naming what is wrong (a part missing, another layout)."""
    import json

    path = os.path.join(directory, HOST_LATEST)
    if not os.path.exists(path):
        if os.path.exists(os.path.join(directory, LATEST)):
            raise ValueError(f"node.checkpoint_dir: {directory} holds the checkpoint of a single-rank host, "
                             f"this host has {world} ranks")
        return None
    try:
        with open(path, "rb") as f:
            pointer = json.loads(f.read(4096))
        seq, pworld, round = (int(pointer[k]) for k in ("seq", "world", "round"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"node.checkpoint_dir: cannot read {path}: {e}") from None
    if pworld != world:
        raise ValueError(f"node.checkpoint_dir: written by a host of {pworld} ranks, this host has {world}")
    for rank in range(world):
        part = host_part_path(directory, seq, rank)
        if not os.path.exists(part):
            raise ValueError(f"node.checkpoint_dir: {part}: the part of rank {rank} is missing")
    return {"seq": seq, "world": world, "round": round}


def load_host_part(directory: str, rank: int, world: int) -> dict | None:
    """Rank ``rank``'s part of the host's latest complete checkpoint (None: no checkpoint)."""
    pointer = host_checkpoint(directory, world)
    if pointer is None:
        return None
    path = host_part_path(directory, pointer["seq"], rank)
    try:
        state = load_tensors(path)
    except Exception as e:
        raise ValueError(f"node.checkpoint_dir: cannot load {path}: {load_error(e)}") from e
    if not isinstance(state, dict) or state.get("rank") != rank or state.get("seq") != pointer["seq"]:
        raise ValueError(f"node.checkpoint_dir: {path} is not the part of rank {rank} of checkpoint {pointer['seq']}")
    worker = state.get("worker")
    if not isinstance(worker, dict) or worker.get("round") != pointer["round"]:
        raise ValueError(f"node.checkpoint_dir: {path} holds another round than the checkpoint "
                         f"({worker.get('round') if isinstance(worker, dict) else '?'} != {pointer['round']})")
    return state
