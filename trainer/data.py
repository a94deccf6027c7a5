"""Training data: where tokens come from, and each peer's sampler over them.

Two sources: byte-level text read into memory (the built-in presets' 256-id
vocabulary, capped at MAX_CORPUS_BYTES), and token datasets that
`gonka-node prepare-data` wrote with a real tokenizer (trainer/tokens.py),
memory-mapped so they can be far larger than memory. One sampler serves both:
a source is a list of 1-D token arrays, and the byte corpus is a list of one.

Every peer reads the same data. The last ``eval_fraction`` of the concatenated
tokens is held out and evaluated identically everywhere, so eval losses of
different peers are comparable (``split_digest()`` lets peers check they hold
the same split); the rest is sampled at random offsets from a stream seeded by
the peer's own key, so peers train on different data without coordinating.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainer.tokens import TokenDataset, is_token_dataset, open_token_dataset

log = logging.getLogger(__name__)

# Reading stops after this many bytes: enough text for any run the built-in
# presets are meant for, and it bounds the memory a mistaken path can take.
# Larger corpora belong in a token dataset (gonka-node prepare-data).
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


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def open_source(paths: list[str], *, verify: bool = True) -> "torch.Tensor | TokenDataset":
    """The training tokens of ``data.paths``: one prepared token-shard directory (``verify``:
    check every shard's sha256 now), or text files and directories read as bytes."""
    datasets = [p for p in paths if is_token_dataset(p)]
    if not datasets:
        return load_corpus(paths)
    if len(paths) > 1:
        raise ValueError(f"data.paths: {datasets[0]} is a token-shard directory; give it alone, not with other paths")
    return open_token_dataset(datasets[0], verify=verify)


def load_corpus(paths: list[str]) -> torch.Tensor:
    """All bytes of ``paths`` (files, or directories read recursively) as one uint8 tensor.

    Files are joined with a newline; an empty list means the default corpus.
    Past MAX_CORPUS_BYTES the rest is ignored, with a warning saying how much.
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
    chunks, total, first_unread = [], 0, None
    for i, file in enumerate(files):
        if total >= MAX_CORPUS_BYTES:
            first_unread = i if first_unread is None else first_unread
            break
        try:
            with open(file, "rb") as f:
                chunk = f.read(MAX_CORPUS_BYTES - total)
                if first_unread is None and f.read(1):
                    first_unread = i  # this file was cut short
        except OSError as e:
            raise ValueError(f"data.paths: cannot read {file!r}: {e.strerror or e}") from e
        chunks.append(chunk)
        total += len(chunk) + 1
    data = b"\n".join(chunks)[:MAX_CORPUS_BYTES]
    if not data.strip():
        raise ValueError(f"data.paths: no data in {', '.join(map(repr, paths[:3]))}{' ...' if len(paths) > 3 else ''}")
    if first_unread is not None:
        available = sum(_size(f) for f in files) + len(files) - 1
        log.warning(
            "data.paths: read only the first %s of %s of text (MAX_CORPUS_BYTES); the remaining %s, from %s on, "
            "is ignored. To train on all of it, tokenize it with `gonka-node prepare-data` and train on the dataset directory",
            _mib(len(data)), _mib(available), _mib(available - len(data)), files[first_unread],
        )
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _size(file: str) -> int:
    try:
        return os.path.getsize(file)
    except OSError:
        return 0


def _stream_seed(shard_key: str, seed: int) -> int:
    # hashlib, not hash(): Python salts str hashes per process, and every run
    # of a peer must draw the same stream.
    digest = hashlib.blake2b(f"{seed}\x00{shard_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass(slots=True)
class _Part:
    """A stretch of one source array: ``tokens`` starts at token ``offset`` of array ``index``."""

    tokens: np.ndarray
    index: int
    offset: int


class _Windows:
    """Where windows of ``width`` tokens can start in a split made of several arrays.

    A window lies within one array (one shard): reading it is one slice of one
    memory map, and the arrays of a source need not continue one another.
    Starts are numbered 0..count-1 through the parts in order; ``read`` turns
    such numbers into tokens.
    """

    def __init__(self, parts: list[_Part], width: int) -> None:
        self.parts = [p for p in parts if len(p.tokens) >= width]
        self.width = width
        counts = np.array([len(p.tokens) - width + 1 for p in self.parts], dtype=np.int64)
        self.ends = np.cumsum(counts)  # window numbers below ends[k] start in parts[:k + 1]
        self.firsts = self.ends - counts
        self.count = int(self.ends[-1]) if len(self.ends) else 0

    def read(self, numbers: np.ndarray, dataset: TokenDataset | None) -> np.ndarray:
        """[len(numbers), width] int64 tokens of the windows numbered ``numbers``.

        With a memory-mapped ``dataset``, the pages each window mapped are
        released right after it is copied, so RSS stays flat however long the
        run and however large the dataset (see TokenDataset.release_pages).
        """
        out = np.empty((len(numbers), self.width), dtype=np.int64)
        which = np.searchsorted(self.ends, numbers, side="right")
        for i, (k, start) in enumerate(zip(which.tolist(), (numbers - self.firsts[which]).tolist())):
            part = self.parts[k]
            out[i] = part.tokens[start : start + self.width]
            if dataset is not None:
                dataset.release_pages(part.index, part.offset + start, self.width)
        return out


def _split(parts: list[_Part], at: int) -> tuple[list[_Part], list[_Part]]:
    """The concatenation of ``parts`` cut at token ``at``, as views: (before, after)."""
    before, after, seen = [], [], 0
    for part in parts:
        n = len(part.tokens)
        if seen + n <= at:
            before.append(part)
        elif seen >= at:
            after.append(part)
        else:
            cut = at - seen
            before.append(_Part(part.tokens[:cut], part.index, part.offset))
            after.append(_Part(part.tokens[cut:], part.index, part.offset + cut))
        seen += n
    return before, after


TokenSource = torch.Tensor | TokenDataset | Sequence[np.ndarray]


class ShardSampler:
    """Batches of (input, next-token target) from one peer's stream over a token source.

    ``source`` is the byte corpus (a 1-D uint8 tensor from load_corpus), a
    TokenDataset, or a list of 1-D integer arrays, each a shard (read as they
    are: only a TokenDataset's mapped pages are handed back after each read).
    """

    def __init__(
        self,
        source: TokenSource,
        *,
        shard_key: str,
        seed: int,
        batch_size: int,
        seq_len: int,
        eval_fraction: float,
    ) -> None:
        self._dataset: TokenDataset | None = None
        self._corpus: torch.Tensor | None = None
        if isinstance(source, torch.Tensor):
            assert source.dtype == torch.uint8 and source.dim() == 1, "corpus must be a 1-D uint8 tensor"
            self._corpus = source
            parts, unit, self.vocab_size = [source.numpy()], "bytes", 256
        elif isinstance(source, TokenDataset):
            self._dataset = source
            parts, unit, self.vocab_size = list(source.shards), "tokens", source.vocab_size
        else:
            parts, unit, self.vocab_size = list(source), "tokens", None
            assert parts and all(isinstance(p, np.ndarray) and p.ndim == 1 for p in parts), "source must be 1-D arrays"
        self._parts = parts
        n = sum(len(p) for p in parts)
        n_eval = int(n * eval_fraction)
        self.eval_start = n - n_eval
        before, after = _split([_Part(p, k, 0) for k, p in enumerate(parts)], self.eval_start)
        # Each split must hold at least one window of seq_len inputs plus the
        # target of its last position, within one shard.
        self._train = _Windows(before, seq_len + 1)
        self._eval = _Windows(after, seq_len + 1)
        if not self._train.count or not self._eval.count:
            need = (seq_len + 1) / min(eval_fraction, 1 - eval_fraction)
            within = f" in {len(parts)} shards, and windows do not cross shards" if len(parts) > 1 else ""
            raise ValueError(
                f"data.paths: corpus too small: {n} {unit}{within}; sequences of {seq_len} tokens with "
                f"eval_fraction {eval_fraction} need at least {int(need) + 1}"
            )
        self.eval_fraction = eval_fraction
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.batches_drawn = 0
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(_stream_seed(shard_key, seed))
        self._digest: str | None = None

    def _windows(self, windows: _Windows, numbers: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = windows.read(numbers, self._dataset)
        # Copied by numpy, not torch: torch splits large copies over its intra-op
        # threads, which are busy training (or other processes'), and waits for them.
        x, y = np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])
        return torch.from_numpy(x), torch.from_numpy(y)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Next training batch: x and y of shape [batch_size, seq_len], y shifted by one."""
        numbers = torch.randint(0, self._train.count, (self.batch_size,), generator=self._generator)
        self.batches_drawn += 1
        return self._windows(self._train, numbers.numpy())

    def eval_batches(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` fixed held-out batches, the same for every shard key."""
        count = n * self.batch_size
        last = self._eval.count - 1  # last valid start
        # Evenly spread windows: deterministic, and they cover the whole split.
        numbers = np.array([(j * last) // max(count - 1, 1) for j in range(count)], dtype=np.int64)
        return [
            self._windows(self._eval, numbers[i * self.batch_size : (i + 1) * self.batch_size])
            for i in range(n)
        ]

    def split_digest(self) -> str:
        """Short hex digest of the data and its held-out split: equal on two peers
        exactly when they train and evaluate on the same tokens."""
        if self._digest is None:
            h = hashlib.sha256()
            if self._dataset is not None:
                h.update(b"token-dataset\0" + self._dataset.manifest_sha256.encode())
            else:
                # Hashes every token once (the byte corpus is at most MAX_CORPUS_BYTES).
                h.update(b"bytes\0" if self._corpus is not None else b"arrays\0")
                for part in self._parts:
                    h.update(f"{part.dtype.str}:{len(part)}\0".encode())
                    h.update(np.ascontiguousarray(part).data)
            h.update(f"\0eval_fraction={self.eval_fraction!r}".encode())
            self._digest = h.hexdigest()[:16]
        return self._digest

    def state_dict(self) -> dict:
        return {"batches_drawn": self.batches_drawn, "generator": self._generator.get_state(), "split": self.split_digest()}

    def load_state_dict(self, d: dict) -> None:
        state = d.get("generator") if isinstance(d, dict) else None
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise ValueError("sampler state: missing or invalid generator state")
        if not isinstance(d.get("batches_drawn"), int) or d["batches_drawn"] < 0:
            raise ValueError("sampler state: missing or invalid batches_drawn")
        # Older checkpoints carry no digest; a digest that differs means other data.
        if "split" in d and d["split"] != self.split_digest():
            raise ValueError(
                f"sampler state: written for data split {d['split']!r}, this sampler reads {self.split_digest()!r} "
                "(other data or eval_fraction)"
            )
        self._generator.set_state(state.clone())
        self.batches_drawn = d["batches_drawn"]
