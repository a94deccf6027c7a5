"""The state a joiner downloads, as one immutable blob: ``Snapshot``.

The global parameters then the outer momentum, fp32, in model order, plus the
round number and ``params_hash``; a blake2b-128 digest of the whole blob and of
every chunk it is served in, so a receiver checks each chunk as it arrives and
the whole before anyone loads it. p2p/stateserver.py serves it, p2p/transfer.py
downloads it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

DIGEST_BYTES = 16  # blake2b-128 of the whole blob and of each chunk


@dataclass(slots=True, frozen=True)
class Snapshot:
    """An immutable copy of the global state at one committed round."""

    round: int
    params_hash: str
    shapes: list[list[int]]
    blob: bytes | bytearray | memoryview  # fp32 values, bytes as they go on the wire
    digest: bytes
    # The blob is served in pieces of chunk_bytes; the digest of every piece lets a
    # receiver check each one as it arrives.
    chunk_bytes: int
    chunk_digests: list[bytes]
    # A multi-rank host's snapshot is its rank's shard of the state; rank 0's also lists every
    # shard's hash (in rank order), which ``params_hash`` is the combined hash of.
    shards: tuple[str, ...] = ()

    @classmethod
    def build(cls, round: int, params_hash: str, params: list[torch.Tensor], momentum: list[torch.Tensor],
              chunk_bytes: int, shards: tuple[str, ...] = (), scratch=None) -> "Snapshot":
        """``scratch(numel)``: where the copy goes (a memory-mapped vector with ``outer.state_dir``,
        trainer/hoststate.py); default a new tensor in RAM."""
        # One copy of the state, in place: the blob is a byte view of it, not another copy.
        tensors = [*params, *momentum]
        numel = sum(t.numel() for t in tensors)
        flat = scratch(numel) if scratch is not None else torch.empty(numel, dtype=torch.float32)
        offset = 0
        for t in tensors:
            flat[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
            offset += t.numel()
        blob = memoryview(flat.numpy()).cast("B")
        return cls(round, params_hash, [list(p.shape) for p in params], blob, digest_of(blob), chunk_bytes,
                   chunk_digests_of(blob, chunk_bytes), tuple(shards))

    def unpack(self) -> dict:
        """The blob back as {'round', 'params', 'momentum'} tensors: views of the blob where it is
        writable (a download's own buffer: no copy of a state that may be hundreds of GB), else
        of a copy. Loading them copies them into the worker's own tensors."""
        view = memoryview(self.blob)
        flat = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.float32)
        tensors, offset = [], 0
        for shape in self.shapes * 2:
            n = numel_of(shape)
            tensors.append(flat[offset : offset + n].view(shape))
            offset += n
        half = len(self.shapes)
        return {"round": self.round, "params": tensors[:half], "momentum": tensors[half:]}


def digest_of(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def chunk_digests_of(blob: bytes, chunk: int) -> list[bytes]:
    view = memoryview(blob)
    return [digest_of(view[i : i + chunk]) for i in range(0, len(blob), chunk)]


def state_bytes(shapes: list[list[int]]) -> int:
    """The blob's size: θ and the outer momentum of these shapes, fp32."""
    return 2 * 4 * sum(numel_of(s) for s in shapes)


def numel_of(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
