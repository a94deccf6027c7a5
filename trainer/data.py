"""Training data: a byte corpus read from disk and each peer's sampler over it.

Every peer reads the same corpus. The last ``eval_fraction`` of it is held out
and evaluated identically everywhere, so eval losses of different peers are
comparable; the rest is sampled at random offsets from a stream seeded by the
peer's own key, so peers train on different data without coordinating.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig

import torch

# Reading stops after this many bytes: enough text for any run the built-in
# presets are meant for, and it bounds the memory a mistaken path can take.
MAX_CORPUS_BYTES = 64 * 1024 * 1024

# Parts of the standard library that are not ordinary source: third-party
# packages and the (huge, repetitive) regression test suites.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def default_corpus_paths() -> list[str]:
    """The standard library's .py files on this machine, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS]
        found.extend(os.path.join(directory, f) for f in files if f.endswith(".py"))
    return sorted(found)


def _files_under(path: str) -> list[str]:
    found = []
    for directory, subdirs, files in os.walk(path):
        subdirs.sort()
        found.extend(os.path.join(directory, f) for f in files)
    return sorted(found)


def load_corpus(paths: list[str]) -> torch.Tensor:
    """All bytes of ``paths`` (files, or directories read recursively) as one uint8 tensor.

    Files are joined with a newline; an empty list means the default corpus.
    """
    if not paths:
        paths = default_corpus_paths()
        if not paths:
            raise ValueError("data.paths: empty, and no Python standard library sources found for the default corpus")
    files = []
    for path in paths:
        if os.path.isdir(path):
            under = _files_under(path)
            if not under:
                raise ValueError(f"data.paths: directory {path!r} contains no files")
            files.extend(under)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise ValueError(f"data.paths: {path!r} does not exist or is not a file or directory")
    chunks, total = [], 0
    for file in files:
        if total >= MAX_CORPUS_BYTES:
            break
        try:
            with open(file, "rb") as f:
                chunk = f.read(MAX_CORPUS_BYTES - total)
        except OSError as e:
            raise ValueError(f"data.paths: cannot read {file!r}: {e.strerror or e}") from e
        chunks.append(chunk)
        total += len(chunk) + 1
    data = b"\n".join(chunks)[:MAX_CORPUS_BYTES]
    if not data.strip():
        raise ValueError(f"data.paths: no data in {', '.join(map(repr, paths[:3]))}{' ...' if len(paths) > 3 else ''}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _stream_seed(shard_key: str, seed: int) -> int:
    # hashlib, not hash(): Python salts str hashes per process, and every run
    # of a peer must draw the same stream.
    digest = hashlib.blake2b(f"{seed}\x00{shard_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class ShardSampler:
    """Batches of (input, next-token target) from one peer's stream over the corpus."""

    def __init__(
        self,
        corpus: torch.Tensor,
        *,
        shard_key: str,
        seed: int,
        batch_size: int,
        seq_len: int,
        eval_fraction: float,
    ) -> None:
        assert corpus.dtype == torch.uint8 and corpus.dim() == 1, "corpus must be a 1-D uint8 tensor"
        n = corpus.numel()
        n_eval = int(n * eval_fraction)
        # Each split must hold at least one window of seq_len inputs plus the
        # target of its last position.
        if n_eval < seq_len + 1 or n - n_eval < seq_len + 1:
            need = (seq_len + 1) / min(eval_fraction, 1 - eval_fraction)
            raise ValueError(
                f"data.paths: corpus too small: {n} bytes; sequences of {seq_len} tokens with "
                f"eval_fraction {eval_fraction} need at least {int(need) + 1}"
            )
        self.eval_start = n - n_eval
        self._train = corpus[: self.eval_start]
        self._eval = corpus[self.eval_start :]
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.batches_drawn = 0
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(_stream_seed(shard_key, seed))

    def _windows(self, data: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        steps = torch.arange(self.seq_len + 1)
        rows = data[offsets.unsqueeze(1) + steps].long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Next training batch: x and y of shape [batch_size, seq_len], y shifted by one."""
        high = self._train.numel() - self.seq_len  # last valid start + 1
        offsets = torch.randint(0, high, (self.batch_size,), generator=self._generator)
        self.batches_drawn += 1
        return self._windows(self._train, offsets)

    def eval_batches(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` fixed held-out batches, the same for every shard key."""
        count = n * self.batch_size
        span = self._eval.numel() - self.seq_len - 1  # last valid start
        # Evenly spread windows: deterministic, and they cover the whole split.
        offsets = torch.tensor([(j * span) // max(count - 1, 1) for j in range(count)])
        return [
            self._windows(self._eval, offsets[i * self.batch_size : (i + 1) * self.batch_size])
            for i in range(n)
        ]

    def state_dict(self) -> dict:
        return {"batches_drawn": self.batches_drawn, "generator": self._generator.get_state()}

    def load_state_dict(self, d: dict) -> None:
        state = d.get("generator") if isinstance(d, dict) else None
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise ValueError("sampler state: missing or invalid generator state")
        if not isinstance(d.get("batches_drawn"), int) or d["batches_drawn"] < 0:
            raise ValueError("sampler state: missing or invalid batches_drawn")
        self._generator.set_state(state.clone())
        self.batches_drawn = d["batches_drawn"]
