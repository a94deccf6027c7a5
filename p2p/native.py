"""The C kernels of the block codecs int8, int4 and fp4, of the sparse codec and of the aggregators' sums
(``nibble.c``): built once per machine, loaded with ctypes.

``kernels()`` gives the loaded kernels, or None where they cannot be had: no C
compiler, a build that fails, or ``GONKA_NATIVE=0`` in the environment. The
codecs then run their torch code, which gives the same bytes and values (the
tests check both), only slower. ctypes releases the GIL for each call, so the
kernels run on the round's worker thread while the event loop goes on.

The library is built with ``$CC`` (default ``cc``) into ``$GONKA_NATIVE_DIR``,
else ``$XDG_CACHE_HOME/gonka-node``, else ``~/.cache/gonka-node``, under a name
that hashes the source, the flags and the compiler, so a changed source is
rebuilt. It is compiled to a temporary name and renamed into place: nodes that
start at once on one host never load a half-written file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("nibble.c")
# -ffp-contract=off: no fused multiply-add, so each value is the single fp32 multiply torch does.
FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno"]
BUILD_TIMEOUT_S = 120.0

# Return codes of the kernels, as p2p.codec.CodecError reasons.
ERRORS = {1: "non_finite_input", 2: "non_finite_scale", 3: "negative_scale", 4: "scale_overflow", 5: "bad_code",
          6: "bad_padding", 7: "bad_index"}
NO_MEMORY = -2  # a kernel's scratch buffer could not be had
# The kind argument of gonka_nibble_encode/decode; int8 has entry points of its own.
NIBBLE_KINDS = {"int4": 0, "fp4": 1}


class CodecKernels:
    """``encode``/``decode`` of whole vectors in the int8, int4 or fp4 wire format, ``sparse_encode``/
    ``sparse_decode`` in the sparse one, and the sums of ``p2p.aggregate``, on raw tensor memory."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._nibble_encode, self._nibble_decode = lib.gonka_nibble_encode, lib.gonka_nibble_decode
        self._int8_encode, self._int8_decode = lib.gonka_int8_encode, lib.gonka_int8_decode
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._nibble_encode.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr]
        self._nibble_decode.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
        self._int8_encode.argtypes = [ptr, i64, i64, ptr, ptr]
        self._int8_decode.argtypes = [ptr, i64, i64, ptr]
        self._sparse_encode, self._sparse_decode = lib.gonka_sparse_encode, lib.gonka_sparse_decode
        self._sparse_encode.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, ptr]
        self._sparse_decode.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, ptr]
        for function in (self._nibble_encode, self._nibble_decode, self._int8_encode, self._int8_decode,
                         self._sparse_encode, self._sparse_decode):
            function.restype = ctypes.c_int
        self._absmax, self._sum_sq = lib.gonka_absmax, lib.gonka_sum_sq_truncated
        self._weighted_sum = lib.gonka_weighted_sum
        self._absmax.argtypes, self._absmax.restype = [ptr, i64], ctypes.c_uint32
        self._sum_sq.argtypes, self._sum_sq.restype = [ptr, i64, ctypes.c_double], i64
        self._weighted_sum.argtypes, self._weighted_sum.restype = [ptr, ptr, i64, i64, ptr], None

    def encode(self, kind: str, x: torch.Tensor, block: int, out: torch.Tensor, decoded: torch.Tensor | None) -> str | None:
        """Fill ``out`` (uint8, the exact wire size) from ``x`` (and ``decoded``); an error reason or None.

        ``kind``: "int8", "int4" or "fp4". The caller checks every shape, dtype and contiguity: the
        kernel trusts them."""
        args = (x.data_ptr(), x.numel(), block, out.data_ptr(), None if decoded is None else decoded.data_ptr())
        code = self._int8_encode(*args) if kind == "int8" else self._nibble_encode(NIBBLE_KINDS[kind], *args)
        return self._reason(code)

    def decode(self, kind: str, payload: torch.Tensor, numel: int, block: int, out: torch.Tensor) -> str | None:
        """Decode ``payload`` (uint8, already checked to be the exact wire size) into ``out``; an error reason or None."""
        args = (payload.data_ptr(), numel, block, out.data_ptr())
        code = self._int8_decode(*args) if kind == "int8" else self._nibble_decode(NIBBLE_KINDS[kind], *args)
        return self._reason(code)

    def sparse_encode(self, x: torch.Tensor, chunk: int, keep: int, bits: int, out: torch.Tensor,
                      decoded: torch.Tensor | None) -> str | None:
        """Fill ``out`` (uint8, the exact wire size) with ``x`` in the sparse format of (chunk, keep, bits)
        (p2p/sparsecodec.py), and ``decoded`` with its values; an error reason or None. The caller
        checks every shape, dtype and contiguity: the kernel trusts them."""
        pointer = None if decoded is None else decoded.data_ptr()
        return self._reason(self._sparse_encode(x.data_ptr(), x.numel(), chunk, keep, bits, out.data_ptr(), pointer))

    def sparse_decode(self, payload: torch.Tensor, numel: int, chunk: int, keep: int, bits: int,
                      out: torch.Tensor | None, mask: torch.Tensor | None) -> str | None:
        """Check ``payload`` (uint8, already checked to be the exact wire size) and decode it into ``out``
        and mark what it keeps in ``mask`` (bool), each where given; an error reason or None."""
        pointers = [None if t is None else t.data_ptr() for t in (out, mask)]
        return self._reason(self._sparse_decode(payload.data_ptr(), numel, chunk, keep, bits, *pointers))

    # The aggregators' sums (p2p/aggregate.py): contiguous fp32 CPU tensors, checked by the caller.

    def absmax(self, x: torch.Tensor) -> float:
        """The largest |value| of ``x`` (finite values)."""
        return struct.unpack("<f", struct.pack("<I", self._absmax(x.data_ptr(), x.numel())))[0]

    def sum_sq_truncated(self, x: torch.Tensor, scale: float) -> int:
        """Σ trunc(x_i · scale)², for a power of two ``scale`` that keeps every term below 2^26
        and the sum below 2^53 (``aggregate.norm``)."""
        return self._sum_sq(x.data_ptr(), x.numel(), scale)

    def weighted_sum(self, xs: list[torch.Tensor], coefficients: list[float], out: torch.Tensor) -> torch.Tensor:
        """``out`` = Σ c_i x_i in order, each product rounded to fp32 before it is added; the
        coefficients are rounded to fp32 first, as torch rounds a Python scalar."""
        m = len(xs)
        pointers = (ctypes.c_void_p * m)(*(x.data_ptr() for x in xs))
        self._weighted_sum(pointers, (ctypes.c_float * m)(*coefficients), m, out.numel(), out.data_ptr())
        return out

    @staticmethod
    def _reason(code: int) -> str | None:
        if code == NO_MEMORY:
            raise MemoryError("codec kernels: no memory for a scratch buffer")
        if code < 0:
            raise ValueError("codec kernels: bad block size, codec settings or numel")
        return ERRORS.get(code) if code else None


def cache_dir() -> Path:
    if os.environ.get("GONKA_NATIVE_DIR"):
        return Path(os.environ["GONKA_NATIVE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gonka-node"


def library_path(compiler: list[str]) -> Path:
    """Where the build of this source with these flags and this compiler lives."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join([*compiler, *FLAGS, platform.machine(), sys.platform]).encode())
    return cache_dir() / f"nibble-{h.hexdigest()[:16]}.so"


def build(compiler: list[str] | None = None) -> Path:
    """Compile the kernels (unless this build is there already) and return the library's path.

    Raises OSError or subprocess.CalledProcessError (with the compiler's output) on failure."""
    compiler = compiler or shlex.split(os.environ.get("CC") or "cc")
    path = library_path(compiler)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([*compiler, *FLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, text=True,
                       timeout=BUILD_TIMEOUT_S)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.lru_cache(maxsize=None)
def kernels() -> CodecKernels | None:
    """The kernels, built on first use; None (after one warning) where they cannot be had."""
    if os.environ.get("GONKA_NATIVE", "1") == "0":
        return None
    if sys.byteorder != "little":
        return None
    try:
        path = build()
        return CodecKernels(ctypes.CDLL(str(path)), path)
    except subprocess.CalledProcessError as e:
        detail = (e.stderr or "").strip().splitlines()[:1]
        log.warning("codec kernels did not build (%s); using the slower torch code", detail or e)
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        log.warning("codec kernels unavailable (%s); using the slower torch code", e)
    return None


if __name__ == "__main__":  # scripts/setup: build now rather than on the first round
    found = kernels()
    print(f"codec kernels: {found.path if found else 'unavailable, the torch code is used'}")
