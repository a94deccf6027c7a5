"""Token datasets on disk: the shard format, the manifest, and opening one for training.

`gonka-node prepare-data` (trainer/prepare.py) writes a dataset directory;
the sampler (trainer/data.py) reads it through memory maps, so a dataset far
larger than memory trains with a bounded footprint, and every peer can check
that it holds byte-identical data (``manifest_sha256``).

Shard file (``shard-NNNNN.bin``), all integers little-endian::

    offset  size  field
    0       8     magic b"GONKATOK"
    8       4     format version (u32), FORMAT_VERSION
    12      4     dtype code (u32): 1 = uint16, 2 = uint32
    16      8     token count (u64)
    24      232   zeros, up to HEADER_BYTES = 256 (room for later fields;
                  keeps the tokens 8-byte aligned for the memory map)
    256     ...   the tokens, count x 2 or 4 bytes, nothing after them

Tokens are uint16 when every id fits (vocab_size <= 65536), else uint32.
Documents follow one another, each ended by the tokenizer's EOS id; a shard
may end in the middle of a document (the sampler never draws a window across
two shards).

``manifest.json`` in the same directory describes the whole dataset::

    {"format": "gonka-tokens", "version": 1,
     "tokenizer": {"sha256": <of tokenizer.json's bytes>, "vocab_size": N,
                   "eos_id": N, "eos_token": "</s>", "source": <path, for information>},
     "dtype": "uint16", "documents": N, "total_tokens": N,
     "shards": [{"file": "shard-00000.bin", "tokens": N, "sha256": <of the whole file>}, ...]}

The manifest is the commit point: it is written last, atomically, so a
directory with a manifest holds complete shards.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct

import numpy as np

from trainer.files import atomic_write

MAGIC = b"GONKATOK"
FORMAT_NAME = "gonka-tokens"
FORMAT_VERSION = 1
HEADER_BYTES = 256
MANIFEST = "manifest.json"
_HEADER = struct.Struct("<8sIIQ")  # magic, version, dtype code, token count
DTYPE_CODES = {1: "uint16", 2: "uint32"}
_CODE_OF = {name: code for code, name in DTYPE_CODES.items()}
# Reads for hashing go through fixed-size chunks: memory stays bounded
# whatever the shard size, and no page of the dataset stays mapped.
_HASH_CHUNK = 8 * 1024 * 1024
# Largest page-cache folio on x86-64 and 4K-page arm64 (one PMD); see release_pages.
RELEASE_ALIGN = 2 * 1024 * 1024


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest shard dtype that holds every id below ``vocab_size``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def pack_header(dtype: str, count: int) -> bytes:
    """The HEADER_BYTES a shard of ``count`` tokens of ``dtype`` starts with."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, _CODE_OF[dtype], count).ljust(HEADER_BYTES, b"\0")


class Stopped(Exception):
    """A long check was told to stop before it finished."""


def file_sha256(path: str, should_stop=None) -> str:
    """sha256 of a file's bytes, read in bounded chunks; ``should_stop()`` is asked between chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            if should_stop is not None and should_stop():
                raise Stopped(path)
    return digest.hexdigest()


def is_token_dataset(path: str) -> bool:
    """Whether ``path`` is a directory holding a token dataset's manifest."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


class TokenDataset:
    """An opened token dataset: its manifest's facts and one read-only memory map per shard.

    ``shards`` are 1-D numpy arrays over the maps. Pages read through them
    count in the process's RSS until the kernel reclaims them, which it does
    only under memory pressure: a long reader would look like it holds the
    whole dataset, so it hands them back with ``release_pages()``.
    """

    def __init__(self, path: str, manifest: dict, manifest_sha256: str, files: list[str], maps: list[mmap.mmap | None]) -> None:
        tokenizer = manifest["tokenizer"]
        self.path = path
        self.manifest = manifest
        self.manifest_sha256 = manifest_sha256
        self.vocab_size: int = tokenizer["vocab_size"]
        self.eos_id: int = tokenizer["eos_id"]
        self.eos_token: str | None = tokenizer.get("eos_token")
        self.tokenizer_sha256: str = tokenizer["sha256"]
        self.dtype: str = manifest["dtype"]
        self.documents: int = manifest["documents"]
        self.total_tokens: int = manifest["total_tokens"]
        self.shard_paths = files
        self._maps = maps
        dtype = np.dtype(self.dtype).newbyteorder("<")
        self.shards: list[np.ndarray] = [
            np.frombuffer(m, dtype=dtype, offset=HEADER_BYTES) if m is not None else np.empty(0, dtype=dtype)
            for m in maps
        ]

    def verify(self, should_stop=None) -> None:
        """Check every shard's sha256 against the manifest; ValueError naming the shard if one differs."""
        verify_shards(self.shard_paths, self.manifest["shards"], should_stop)

    def release_pages(self, shard: int | None = None, start: int = 0, count: int | None = None) -> None:
        """Unmap this process's pages of tokens [start, start + count) of ``shard`` (all
        shards by default). They stay in the page cache: the next read maps them again.

        The range grows to whole RELEASE_ALIGN blocks: the page cache holds file
        data in folios of up to that size, and a read fault maps the whole folio,
        so one window read can map far more than the window.
        """
        for k in range(len(self._maps)) if shard is None else (shard,):
            m = self._maps[k]
            if m is None:
                continue
            itemsize = self.shards[k].itemsize
            first = HEADER_BYTES + start * itemsize
            last = len(m) if count is None else first + count * itemsize
            first -= first % RELEASE_ALIGN
            last = min(len(m), -(-last // RELEASE_ALIGN) * RELEASE_ALIGN)
            if last > first:
                m.madvise(mmap.MADV_DONTNEED, first, last - first)

    def __repr__(self) -> str:
        return f"TokenDataset({self.path!r}, {len(self.shards)} shards, {self.total_tokens} {self.dtype} tokens)"


def _fail(path: str, what: str) -> ValueError:
    return ValueError(f"data.paths: {path}: {what}")


def _field(manifest: dict, path: str, key: str, kind: type, where: dict | None = None):
    holder = manifest if where is None else where
    value = holder.get(key) if isinstance(holder, dict) else None
    # bool is an int in Python, never a count here.
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
        raise _fail(path, f"manifest field {key!r} missing or not {'a non-negative integer' if kind is int else 'a ' + kind.__name__}")
    return value


def _read_manifest(path: str) -> tuple[dict, str]:
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise _fail(path, "no such dataset directory")
    try:
        with open(manifest_path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise _fail(manifest_path, "missing; not a token dataset (create one with `gonka-node prepare-data`)") from None
    except OSError as e:
        raise _fail(manifest_path, f"cannot read: {e.strerror or e}") from None
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(manifest_path, f"not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise _fail(manifest_path, f"not a {FORMAT_NAME} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise _fail(manifest_path, f"unknown format version {manifest.get('version')!r} (this gonka-node reads {FORMAT_VERSION})")
    tokenizer = manifest.get("tokenizer")
    if not isinstance(tokenizer, dict):
        raise _fail(manifest_path, "manifest field 'tokenizer' missing or not an object")
    for key in ("vocab_size", "eos_id"):
        _field(manifest, manifest_path, key, int, tokenizer)
    _field(manifest, manifest_path, "sha256", str, tokenizer)
    if tokenizer["eos_id"] >= tokenizer["vocab_size"]:
        raise _fail(manifest_path, f"eos_id {tokenizer['eos_id']} is outside the vocabulary of {tokenizer['vocab_size']}")
    if manifest.get("dtype") not in _CODE_OF:
        raise _fail(manifest_path, f"unknown dtype {manifest.get('dtype')!r} (known: {', '.join(_CODE_OF)})")
    if dtype_for_vocab(max(tokenizer["vocab_size"], 1)) == "uint32" and manifest["dtype"] == "uint16":
        raise _fail(manifest_path, f"dtype uint16 cannot hold a vocabulary of {tokenizer['vocab_size']}")
    for key in ("documents", "total_tokens"):
        _field(manifest, manifest_path, key, int)
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards:
        raise _fail(manifest_path, "manifest field 'shards' missing or empty")
    for shard in shards:
        name = _field(manifest, manifest_path, "file", str, shard)
        # Only plain names: a manifest cannot point outside its directory.
        if os.path.basename(name) != name or name.startswith("."):
            raise _fail(manifest_path, f"shard file name {name!r} is not a plain file name")
        _field(manifest, manifest_path, "tokens", int, shard)
        _field(manifest, manifest_path, "sha256", str, shard)
    total = sum(shard["tokens"] for shard in shards)
    if total != manifest["total_tokens"]:
        raise _fail(manifest_path, f"total_tokens is {manifest['total_tokens']} but the shards hold {total}")
    return manifest, hashlib.sha256(raw).hexdigest()


def _check_shard(file: str, shard: dict, dtype: str) -> None:
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            header = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise _fail(file, "shard missing") from None
    except OSError as e:
        raise _fail(file, f"cannot read shard: {e.strerror or e}") from None
    if len(header) < _HEADER.size:
        raise _fail(file, f"truncated shard: {size} bytes, shorter than its header")
    magic, version, code, count = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise _fail(file, f"not a token shard (magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise _fail(file, f"unknown shard format version {version} (this gonka-node reads {FORMAT_VERSION})")
    if code not in DTYPE_CODES:
        raise _fail(file, f"unknown dtype code {code} in shard header")
    if DTYPE_CODES[code] != dtype:
        raise _fail(file, f"shard holds {DTYPE_CODES[code]} tokens, the manifest says {dtype}")
    if count != shard["tokens"]:
        raise _fail(file, f"header counts {count} tokens, the manifest {shard['tokens']}")
    expected = HEADER_BYTES + count * np.dtype(dtype).itemsize
    if size < expected:
        raise _fail(file, f"truncated shard: {size} bytes, {count} tokens need {expected}")
    if size > expected:
        raise _fail(file, f"shard has {size - expected} bytes after its {count} tokens")


def verify_shards(files: list[str], shards: list[dict], should_stop=None) -> None:
    """Check every shard's sha256 against the manifest (reads each byte once, in bounded memory);
    raises Stopped as soon as ``should_stop()`` says so."""
    for file, shard in zip(files, shards):
        actual = file_sha256(file, should_stop)
        if actual != shard["sha256"]:
            raise _fail(file, f"sha256 is {actual}, the manifest says {shard['sha256']} (corrupt or changed shard)")


def open_token_dataset(path: str, *, verify: bool = True) -> TokenDataset:
    """Open the dataset directory ``path``, checking its manifest and every shard's header
    and size; ``verify`` also checks each shard's sha256 (reads every byte once).

    Any problem raises ValueError, one line: ``data.paths: FILE: what is wrong``.
    """
    manifest, manifest_sha256 = _read_manifest(path)
    files = [os.path.join(path, shard["file"]) for shard in manifest["shards"]]
    for file, shard in zip(files, manifest["shards"]):
        _check_shard(file, shard, manifest["dtype"])
    if verify:
        verify_shards(files, manifest["shards"])
    maps: list[mmap.mmap | None] = []
    for file, shard in zip(files, manifest["shards"]):
        if shard["tokens"] == 0:
            maps.append(None)  # mmap cannot map the empty rest of the file
            continue
        with open(file, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        # Reads are random windows: readahead would fetch (and map) pages nobody uses.
        m.madvise(mmap.MADV_RANDOM)
        maps.append(m)
    return TokenDataset(path, manifest, manifest_sha256, files, maps)


def write_manifest(directory: str, *, tokenizer: dict, dtype: str, documents: int, shards: list[dict]) -> dict:
    """Write ``directory``'s manifest.json atomically (the dataset's commit point) and return it.

    ``tokenizer`` holds sha256, vocab_size, eos_id, eos_token and source;
    ``shards`` one {"file", "tokens", "sha256"} per shard, in order.
    """
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tokenizer": tokenizer,
        "dtype": dtype,
        "documents": documents,
        "total_tokens": sum(shard["tokens"] for shard in shards),
        "shards": shards,
    }
    data = (json.dumps(manifest, indent=2) + "\n").encode()

    def write(f) -> None:
        os.fchmod(f.fileno(), 0o644)  # a dataset is no secret (atomic_write starts at 0600)
        f.write(data)

    atomic_write(os.path.join(directory, MANIFEST), write)
    return manifest


class ShardWriter:
    """Appends tokens to the shard files of a new dataset in ``directory``, starting a
    new shard every ``shard_tokens`` tokens; ``finish`` writes the manifest."""

    def __init__(self, directory: str, *, dtype: str, shard_tokens: int) -> None:
        assert dtype in _CODE_OF and shard_tokens > 0
        self.directory = directory
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self._file = None
        self._count = 0

    def add(self, tokens: np.ndarray) -> None:
        assert tokens.ndim == 1 and tokens.dtype == self.dtype, (tokens.dtype, self.dtype)
        while len(tokens):
            if self._file is None:
                name = shard_name(len(self.shards))
                self._file = open(os.path.join(self.directory, name), "wb")
                self._file.write(pack_header(self.dtype.name, 0))
                self._count = 0
            take = tokens[: self.shard_tokens - self._count]
            self._file.write(memoryview(take).cast("B"))
            self._count += len(take)
            tokens = tokens[len(take) :]
            if self._count == self.shard_tokens:
                self.end_shard()

    def end_shard(self) -> None:
        """Close the shard being written (if any): the next tokens start a new one."""
        if self._file is None:
            return
        f, self._file = self._file, None
        f.seek(0)
        f.write(pack_header(self.dtype.name, self._count))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        # Hashed from what is on disk, so the manifest vouches for the file as written.
        self.shards.append({"file": os.path.basename(f.name), "tokens": self._count, "sha256": file_sha256(f.name)})

    def finish(self, *, tokenizer: dict, documents: int) -> dict:
        """Close the last shard and commit the dataset; returns the manifest."""
        self.end_shard()
        assert self.shards, "no tokens written"
        return write_manifest(self.directory, tokenizer=tokenizer, dtype=self.dtype.name, documents=documents, shards=self.shards)

    def abort(self) -> None:
        """Close the open shard, if any, leaving the directory for the caller to remove."""
        if self._file is not None:
            self._file.close()
            self._file = None
