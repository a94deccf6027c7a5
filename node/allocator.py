"""The C allocator's policy for a node's process: keep freed memory of mid-sized tensors for reuse.

A sync's tensor work allocates temporaries of 0.1-1 MB per piece, hundreds per
round (``p2p/exchange.py``). glibc's malloc serves such sizes from mmap at
first and adapts its threshold as chunks are freed, but also trims free memory
at the top of a heap once it exceeds twice that threshold; a round's mix of
sizes kept it trimming and faulting the pages back in. Measured on the 4-host
100 Mbit/s testbed, fp4 (whose temporaries mix 1 MB int32, 256 KB and 128 KB
tensors): 2.03-2.11 s per sync of 25M values without, 1.92 s with these
settings (int4, with fewer sizes, was unaffected). Tensors above
``MMAP_THRESHOLD`` (model weights, whole-vector buffers) still get their own
mappings and go back to the system when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts; below it, freed chunks stay in the heap for reuse
TRIM_THRESHOLD = 256 << 20  # free memory a heap keeps at its top before returning it


def tune_malloc() -> bool:
    """Apply the policy above if the process runs on glibc; False (and nothing changed) elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): keep its defaults
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.debug("mallopt refused the allocator policy; keeping the defaults")
    return ok
