"""Training data: where tokens come from, and each peer's sampler over them.

Two sources: byte-level text read into memory (the built-in presets' 256-id
vocabulary, capped at MAX_CORPUS_BYTES), and token datasets that
`gonka-node prepare-data` wrote with a real tokenizer (trainer/tokens.py),
memory-mapped so they can be far larger than memory. One sampler serves both:
a source is a list of 1-D token arrays, and the byte corpus is a list of one.

Every peer reads the same data. The last ``eval_fraction`` of the concatenated
tokens is held out and evaluated identically everywhere, so eval losses of
different peers are comparable (``split_digest()`` lets peers check they hold
the same split). The rest is the training split, and which of its windows a
peer trains on is assigned, not kept as private state: the batches of step j of
round r for peer p are a pure function of (run key, p, r, j) and the data
(``assigned_windows``). So anyone holding the data can reconstruct any member's
batches of any round (``ShardSampler.assigned_batches``), and a checker can
test a member's update against the data it was meant to be trained on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
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


def _round_key(run_key: str, shard_key: str, round: int) -> bytes:
    # hashlib, not hash(): Python salts str hashes per process, and every peer must
    # derive the same key for a member's round.
    return hashlib.blake2b(f"assigned\x00{run_key}\x00{shard_key}\x00{round}".encode(), digest_size=32).digest()


def _numbers(key: bytes, index: int, n: int, count: int) -> np.ndarray:
    """``n`` numbers in [0, count) from blake2b keyed by ``key`` over (``index``, block): eight
    64-bit values per hash. Reduced modulo ``count``: the bias is below count / 2**64."""
    blocks = b"".join(hashlib.blake2b(struct.pack("<QQ", index, b), digest_size=64, key=key).digest()
                      for b in range(-(-n // 8)))
    return (np.frombuffer(blocks, dtype="<u8")[:n] % np.uint64(count)).astype(np.int64)


def _stream(key: bytes, first: int, n: int, count: int) -> np.ndarray:
    """Windows ``first`` .. ``first + n - 1`` of the stream keyed by ``key``: window w is the
    64-bit value w % 8 of blake2b over (0, w // 8), reduced modulo ``count``."""
    if n <= 0:
        return np.empty(0, dtype=np.int64)
    b0, b1 = first // 8, (first + n - 1) // 8 + 1
    blocks = b"".join(hashlib.blake2b(struct.pack("<QQ", 0, b), digest_size=64, key=key).digest()
                      for b in range(b0, b1))
    values = np.frombuffer(blocks, dtype="<u8")[first - 8 * b0 : first - 8 * b0 + n]
    return (values % np.uint64(count)).astype(np.int64)


def stream_windows(run_key: str, shard_key: str, round: int, windows: range, count: int) -> np.ndarray:
    """The training windows (numbers of ``count``) at positions ``windows`` of peer ``shard_key``'s
    stream of ``round``: a member that trained T tokens in the round (sequences of seq_len)
    trained exactly its first T / seq_len, whatever its batch size (``assigned_windows``). A
    checker reconstructs them from the member's claim alone (p2p/checks.py)."""
    assert round >= 0 and windows.step == 1 and windows.start >= 0
    return _stream(_round_key(run_key, shard_key, round), windows.start, len(windows), count)


def assigned_windows(run_key: str, shard_key: str, round: int, steps: range | int, batch_size: int,
                     count: int) -> np.ndarray:
    """[len(steps), batch_size] int64: the numbers of the training windows (of ``count``) of
    the given steps of ``round`` for the peer ``shard_key``; a pure function.

    ``run_key`` is the run's fingerprint digest (``Fingerprint.digest``), or, where none is
    known, ``"seed:<node.seed>"``. ``round`` is numbered as the round's commit (its
    certificate, the history line, the ``committed round=`` log line): the round whose average
    the steps' pseudo-gradient goes into. ``shard_key`` is the peer id, ``<peer id>/rank<k>``
    for rank k of a multi-rank host (each rank draws its own batches).

    The peer's round is one stream of windows (``stream_windows``), and step j with batch b
    takes windows j b .. (j + 1) b - 1 of it: the windows trained depend on the tokens trained,
    not on how they were batched, so a checker that knows only a member's token claim knows
    its windows. The stream is counter-mode blake2b keyed by a hash of (run key, shard key,
    round): any window is computed directly, and no library's random stream (torch's and
    numpy's generators may change between versions) decides which data a checker reconstructs.

    Another peer's windows are drawn from the same split by another key: two peers' streams
    overlap only by chance (a window one peer draws in a round is among another's n draws
    of it with probability about n / count), and never reach the held-out split. Disjoint
    streams would need the membership of every round known before it trains."""
    steps = range(steps) if isinstance(steps, int) else steps
    assert count > 0 and batch_size > 0 and round >= 0
    key = _round_key(run_key, shard_key, round)
    out = np.empty((len(steps), batch_size), dtype=np.int64)
    for row, j in enumerate(steps):
        assert j >= 0
        out[row] = _stream(key, j * batch_size, batch_size, count)
    return out


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
    """Batches of (input, next-token target) over a token source: this peer's assigned training
    batches, any other peer's, and the held-out ones.

    ``source`` is the byte corpus (a 1-D uint8 tensor from load_corpus), a
    TokenDataset, or a list of 1-D integer arrays, each a shard (read as they
    are: only a TokenDataset's mapped pages are handed back after each read).

    The sampler's position is (``round``, ``step``): the round it draws for (numbered as
    that round's commit, ``assigned_windows``) and the batches drawn in it so far. The worker
    sets it before each phase of inner steps (``seek``, from ``DiLoCoWorker.train_for``);
    ``next_batch`` draws step ``step`` of ``round`` and counts on. Until told a round it is
    round 0, which no swarm round uses: a sampler that is never told counts its steps on in
    one stream.
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
        """``shard_key``: this peer's key (its peer id); ``seed``: the run key's stand-in until
        the run's fingerprint is known (``run_key``)."""
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
        self.shard_key = shard_key
        # The run's fingerprint digest once the node knows it (DiLoCoWorker.assign_data); the
        # seed stands in before (unit tests, the simulator), so nothing else needs to know it.
        self.run_key = f"seed:{seed}"
        self.round = 0
        self.step = 0
        self._digest: str | None = None

    def _windows(self, windows: _Windows, numbers: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = windows.read(numbers, self._dataset)
        # Copied by numpy, not torch: torch splits large copies over its intra-op
        # threads, which are busy training (or other processes'), and waits for them.
        x, y = np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])
        return torch.from_numpy(x), torch.from_numpy(y)

    def seek(self, round: int, step: int = 0) -> None:
        """Draw for ``round`` from now on, ``step`` of its batches drawn already (a phase after
        the first in the round, or a run resumed mid-round)."""
        assert round >= 0 and step >= 0, (round, step)
        self.round, self.step = round, step

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This peer's next training batch: step ``step`` of ``round``; x and y of shape
        [batch_size, seq_len], y shifted by one."""
        numbers = assigned_windows(self.run_key, self.shard_key, self.round, range(self.step, self.step + 1),
                                   self.batch_size, self._train.count)
        self.step += 1
        return self._windows(self._train, numbers[0])

    def assigned_batches(self, shard_key: str, round: int,
                         steps: range | int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The training batches of peer ``shard_key`` at ``steps`` of ``round`` (an int n: its
        first n), under this sampler's run key: exactly what that peer's sampler drew, or will
        draw, whatever its state (``assigned_windows``). ``steps`` is ``range(n)`` for a
        member that sent n steps' worth of tokens in that round."""
        numbers = assigned_windows(self.run_key, shard_key, round, steps, self.batch_size, self._train.count)
        return [self._windows(self._train, row) for row in numbers]

    def stream_batches(self, shard_key: str, round: int, windows: range) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Windows ``windows`` of peer ``shard_key``'s stream of ``round`` (``stream_windows``), in
        batches of this sampler's batch size."""
        numbers = stream_windows(self.run_key, shard_key, round, windows, self._train.count)
        return [self._windows(self._train, numbers[i : i + self.batch_size])
                for i in range(0, len(numbers), self.batch_size)]

    def heldout_batch(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch of the held-out split chosen by ``seed`` (a checker's draw): the same on every
        peer for the same data and seed, and never a training window (the splits are disjoint)."""
        key = hashlib.blake2b(f"heldout\x00{int(seed)}".encode(), digest_size=32).digest()
        return self._windows(self._eval, _numbers(key, 0, self.batch_size, self._eval.count))

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
        """The position (round, batches drawn in it) and the data it is a position in: with the
        run key, all that decides the batches to come."""
        return {"round": self.round, "steps": self.step, "split": self.split_digest()}

    def load_state_dict(self, d: dict) -> None:
        """A position from ``state_dict``. A state from before assigned data (a generator state
        and a count of batches drawn) still loads: the generator is ignored and the count becomes
        the step of round 0, the stream of a sampler never told its round; a worker that trains
        through ``trainer.round.PeerRounds`` is told its round and step before it draws."""
        if not isinstance(d, dict):
            raise ValueError("sampler state: expected a dict")
        legacy = "generator" in d
        if legacy:
            state = d["generator"]
            if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
                raise ValueError("sampler state: missing or invalid generator state")
            position = {"round": 0, "steps": d.get("batches_drawn")}
        else:
            position = {"round": d.get("round"), "steps": d.get("steps")}
        for key, value in position.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                name = "batches_drawn" if legacy and key == "steps" else key
                raise ValueError(f"sampler state: missing or invalid {name}")
        # Older checkpoints carry no digest; a digest that differs means other data.
        if "split" in d and d["split"] != self.split_digest():
            raise ValueError(
                f"sampler state: written for data split {d['split']!r}, this sampler reads {self.split_digest()!r} "
                "(other data or eval_fraction)"
            )
        self.seek(position["round"], position["steps"])
