"""The pipeline behind `gonka-node prepare-data`: text in, a token dataset out.

Tokenizing is the slow part (a few MB of text per second per core), so it
runs in worker processes, each with its own copy of the tokenizer. The main
process only plans the work, in a fixed order, and writes the results in that
same order; so the dataset is byte-identical whatever the number of workers.

Work is planned as units of about UNIT_BYTES of input, each a list of
segments: a whole text file, a piece of a large one, or a range of lines of a
.jsonl file. Workers read their segments themselves, so no text passes
through the main process. A text file longer than PIECE_BYTES is tokenized in
pieces cut just after a newline, which bounds a worker's memory; tokens at a
cut may then differ from tokenizing the file in one go, as if the document
had a break there.

Nothing half-written is ever visible: the dataset is built in a hidden
temporary directory next to the output and renamed into place once its
manifest is written; any failure removes it.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from trainer.tokens import ShardWriter, TokenDataset, dtype_for_vocab, open_token_dataset

# Input per work unit: big enough that handing it to a worker costs nothing
# next to tokenizing it, small enough to keep all workers busy to the end.
UNIT_BYTES = 1 << 20
# A text file longer than this is tokenized in pieces (see the module docstring).
PIECE_BYTES = 16 << 20
# Units in flight per worker: keeps workers fed while bounding the memory of
# results waiting for their turn to be written.
_AHEAD_PER_WORKER = 4


class InputError(ValueError):
    """Bad input to prepare-data; the message is one line naming the path or flag."""


@dataclass(kw_only=True, slots=True)
class PrepareConfig:
    """One prepare-data run; each field is the command-line flag of the same name."""

    # Hugging Face tokenizer directory holding tokenizer.json (--tokenizer).
    tokenizer: str
    # Dataset directory to create; must not exist, or be empty (--out).
    out: str
    # Text files, directories (recursive, sorted) and .jsonl files (INPUT...).
    inputs: list[str]
    # Key of the document text in each .jsonl object (--text-key).
    text_key: str = "text"
    # Tokenizing processes; 0 = the CPUs this process may use, at most 8 (--workers).
    workers: int = 0
    # Tokens per shard file; the last one holds the rest (--shard-tokens).
    shard_tokens: int = 100_000_000
    # A progress bar on stderr, when stderr is a terminal.
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.inputs:
            raise InputError("INPUT: give at least one file or directory")
        if not self.text_key:
            raise InputError("--text-key: must not be empty")
        if self.workers < 0:
            raise InputError(f"--workers: must be at least 1, got {self.workers}")
        if self.shard_tokens < 1:
            raise InputError(f"--shard-tokens: must be at least 1, got {self.shard_tokens}")

    def worker_count(self) -> int:
        return self.workers or min(len(os.sched_getaffinity(0)), 8)


@dataclass(kw_only=True, slots=True)
class TokenizerInfo:
    """What the dataset records about its tokenizer (manifest "tokenizer")."""

    path: str
    file: str  # tokenizer.json
    sha256: str
    vocab_size: int
    eos_id: int
    eos_token: str

    def manifest(self) -> dict:
        return {"sha256": self.sha256, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "eos_token": self.eos_token, "source": os.path.abspath(self.path)}


def _read_json(path: str) -> dict | None:
    """A JSON object file, or None when absent."""
    try:
        with open(path, "rb") as f:
            value = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read as JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: not a JSON object")
    return value


def load_tokenizer_info(path: str) -> TokenizerInfo:
    """Check the tokenizer directory ``path`` and find its end-of-sequence token."""
    from tokenizers import Tokenizer

    if not os.path.isdir(path):
        raise InputError(f"--tokenizer {path}: no such directory")
    file = os.path.join(path, "tokenizer.json")
    try:
        with open(file, "rb") as f:
            raw = f.read()
        tokenizer = Tokenizer.from_str(raw.decode())
    except FileNotFoundError:
        raise InputError(f"--tokenizer {path}: no tokenizer.json (only fast, tokenizers-format tokenizers are supported)") from None
    except Exception as e:  # tokenizers raises its own exception type for bad files
        raise InputError(f"{file}: not a tokenizer: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    # Ids need not be dense (added tokens): size the dtype by the largest one.
    vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1)
    eos_token, eos_id = None, None
    config_file = os.path.join(path, "tokenizer_config.json")
    config = _read_json(config_file)
    if config and config.get("eos_token") is not None:
        eos_token = config["eos_token"]
        if isinstance(eos_token, dict):
            eos_token = eos_token.get("content")
        if not isinstance(eos_token, str):
            raise InputError(f"{config_file}: eos_token is neither a string nor {{\"content\": string}}")
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise InputError(f"{config_file}: eos_token {eos_token!r} is not in the vocabulary of {file}")
    else:
        for name in ("config.json", "generation_config.json"):
            value = (_read_json(os.path.join(path, name)) or {}).get("eos_token_id")
            if isinstance(value, list) and value:
                value = value[0]  # several accepted ends: the first is the canonical one
            if isinstance(value, int) and not isinstance(value, bool):
                if not 0 <= value < vocab_size:
                    raise InputError(f"{os.path.join(path, name)}: eos_token_id {value} is outside the vocabulary of {vocab_size}")
                eos_id, eos_token = value, tokenizer.id_to_token(value)
                break
    if eos_id is None:
        raise InputError(
            f"--tokenizer {path}: no end-of-sequence token: no eos_token in tokenizer_config.json "
            "and no eos_token_id in config.json or generation_config.json"
        )
    return TokenizerInfo(path=path, file=file, sha256=hashlib.sha256(raw).hexdigest(), vocab_size=vocab_size,
                         eos_id=eos_id, eos_token=eos_token or "")


# -- planning -------------------------------------------------------------


@dataclass(slots=True)
class Segment:
    """Bytes [start, end) of ``path``: text (``last``: the document ends here) or .jsonl lines."""

    path: str
    start: int
    end: int
    jsonl: bool
    last: bool = True


@dataclass(slots=True)
class Unit:
    segments: list[Segment] = field(default_factory=list)
    size: int = 0


def list_input_files(inputs: list[str]) -> list[str]:
    """The files ``inputs`` name, in order: directories recursively and sorted, hidden entries skipped."""
    files = []
    for path in inputs:
        if os.path.isdir(path):
            found = []
            for directory, subdirs, names in os.walk(path):
                subdirs[:] = [d for d in subdirs if not d.startswith(".")]
                found.extend(os.path.join(directory, n) for n in names if not n.startswith("."))
            if not found:
                raise InputError(f"{path}: directory holds no files")
            files.extend(sorted(found))
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise InputError(f"{path}: no such file or directory")
    return files


def _next_line_start(f, offset: int, end: int) -> int:
    """The first offset >= ``offset`` just after a newline (or ``end``)."""
    f.seek(offset)
    while offset < end:
        block = f.read(min(1 << 16, end - offset))
        if not block:
            return end
        i = block.find(b"\n")
        if i >= 0:
            return offset + i + 1
        offset += len(block)
    return end


def _segments(path: str, size: int) -> Iterator[Segment]:
    jsonl = path.endswith(".jsonl")
    step = UNIT_BYTES if jsonl else PIECE_BYTES
    if size <= step:
        yield Segment(path, 0, size, jsonl)
        return
    with open(path, "rb") as f:
        start = 0
        while start < size:
            end = _next_line_start(f, start + step, size)
            yield Segment(path, start, end, jsonl, last=end == size)
            start = end


def plan_units(files: list[str]) -> Iterator[Unit]:
    """Work units over ``files`` in order; the same plan whatever the number of workers."""
    unit = Unit()
    for path in files:
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
        for segment in _segments(path, size):
            unit.segments.append(segment)
            unit.size += segment.end - segment.start
            if unit.size >= UNIT_BYTES:
                yield unit
                unit = Unit()
    if unit.segments:
        yield unit


# -- tokenizing (in the workers) --------------------------------------------

# Set once per worker process by _init_worker.
_tokenizer = None
_eos_id = 0
_dtype = np.dtype(np.uint16)
_text_key = "text"


def _init_worker(tokenizer_file: str, eos_id: int, dtype: str, text_key: str) -> None:
    global _tokenizer, _eos_id, _dtype, _text_key
    from tokenizers import Tokenizer

    # One worker is one core: the tokenizer's own thread pool would compete
    # with the other workers for the same cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _tokenizer = Tokenizer.from_file(tokenizer_file)
    _eos_id, _dtype, _text_key = eos_id, np.dtype(dtype).newbyteorder("<"), text_key


def _line_number(path: str, offset: int) -> int:
    """1-based number of the line starting at byte ``offset`` (counted only to report an error)."""
    count = 1
    with open(path, "rb") as f:
        while offset > 0:
            block = f.read(min(1 << 20, offset))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count


def _jsonl_documents(segment: Segment, data: bytes) -> list[str]:
    texts, offset = [], segment.start
    for line in data.split(b"\n"):
        where = offset
        offset += len(line) + 1
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as e:
            raise InputError(f"{segment.path}:{_line_number(segment.path, where)}: not valid JSON ({str(e).splitlines()[0]})") from None
        if not isinstance(value, dict):
            raise InputError(f"{segment.path}:{_line_number(segment.path, where)}: not a JSON object")
        text = value.get(_text_key)
        if text is None:
            raise InputError(f"{segment.path}:{_line_number(segment.path, where)}: no {_text_key!r} key (see --text-key)")
        if not isinstance(text, str):
            raise InputError(f"{segment.path}:{_line_number(segment.path, where)}: {_text_key!r} is not a string")
        texts.append(text)
    return texts


def tokenize_unit(unit: Unit) -> tuple[np.ndarray, int, int]:
    """(tokens, documents ended, input bytes) of one unit, EOS after every document."""
    texts: list[str] = []
    ends: list[bool] = []  # per text: whether EOS follows it
    for segment in unit.segments:
        try:
            with open(segment.path, "rb") as f:
                f.seek(segment.start)
                data = f.read(segment.end - segment.start)
        except OSError as e:
            raise InputError(f"{segment.path}: cannot read: {e.strerror or e}") from None
        if segment.jsonl:
            docs = _jsonl_documents(segment, data)
            texts.extend(docs)
            ends.extend([True] * len(docs))
        else:
            try:
                texts.append(data.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise InputError(f"{segment.path}: not UTF-8 text (invalid byte at offset {segment.start + e.start})") from None
            ends.append(segment.last)
    # The fast variant skips computing character offsets, which are not kept.
    encodings = _tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    ids: list[int] = []
    for encoding, end in zip(encodings, ends):
        ids.extend(encoding.ids)
        if end:
            ids.append(_eos_id)
    return np.array(ids, dtype=_dtype), sum(ends), unit.size


@contextlib.contextmanager
def _tokenized(units: Iterator[Unit], workers: int, initargs: tuple) -> Iterator[Iterator[tuple[np.ndarray, int, int]]]:
    """The results of tokenize_unit over ``units``, in order, from ``workers`` processes."""
    if workers == 1:
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        _init_worker(*initargs)
        try:
            yield (tokenize_unit(unit) for unit in units)
        finally:
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
        return
    # spawn, not fork: the caller may hold threads (torch, the tokenizer's
    # pool) that a forked child would inherit in an unknown state.
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=initargs) as pool:

        def ordered() -> Iterator[tuple[np.ndarray, int, int]]:
            pending: collections.deque = collections.deque()
            for unit in units:
                pending.append(pool.apply_async(tokenize_unit, (unit,)))
                if len(pending) >= _AHEAD_PER_WORKER * workers:
                    yield pending.popleft().get()
            while pending:
                yield pending.popleft().get()

        yield ordered()


# -- the run ----------------------------------------------------------------


def _check_out(out: str) -> None:
    if os.path.lexists(out) and not os.path.isdir(out):
        raise InputError(f"--out {out}: exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        raise InputError(f"--out {out}: exists and is not empty")


def _progress_bar(enabled: bool):
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, pipes, tests).
    return tqdm(desc="tokenizing", unit="tok", unit_scale=True, file=sys.stderr,
                disable=None if enabled else True, dynamic_ncols=True)


def prepare_dataset(config: PrepareConfig) -> TokenDataset:
    """Tokenize ``config.inputs`` into the new dataset ``config.out`` and return it, opened."""
    info = load_tokenizer_info(config.tokenizer)
    files = list_input_files(config.inputs)
    out = os.path.abspath(config.out)
    _check_out(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    dtype = dtype_for_vocab(info.vocab_size)
    total_bytes = sum(os.path.getsize(f) for f in files)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)
    writer = ShardWriter(tmp, dtype=dtype, shard_tokens=config.shard_tokens)
    bar = _progress_bar(config.progress)
    try:
        documents = tokens = done_bytes = 0
        initargs = (info.file, info.eos_id, dtype, config.text_key)
        with _tokenized(plan_units(files), config.worker_count(), initargs) as results:
            for unit_tokens, unit_documents, unit_bytes in results:
                writer.add(unit_tokens)
                documents += unit_documents
                tokens += len(unit_tokens)
                done_bytes += unit_bytes
                # Tokens to come, estimated from the tokens per byte so far: a percentage and an ETA.
                bar.total = max(tokens, int(tokens * total_bytes / max(done_bytes, 1)))
                bar.update(len(unit_tokens))
        if documents == 0:
            raise InputError(f"INPUT: no documents in {', '.join(config.inputs[:3])}{' ...' if len(config.inputs) > 3 else ''}")
        writer.finish(tokenizer=info.manifest(), documents=documents)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a dataset is shared data
        _check_out(out)  # someone may have filled it meanwhile; rename would then fail less clearly
        os.rename(tmp, out)  # replaces an empty directory, atomically
    except BaseException:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    dir_fd = os.open(parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return open_token_dataset(out, verify=False)
