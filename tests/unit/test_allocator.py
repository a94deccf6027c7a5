"""The node's malloc policy: a round's mid-sized temporaries reuse freed memory instead of faulting fresh pages."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                 reason="not glibc: the node keeps the platform allocator's defaults")]

ROOT = Path(__file__).resolve().parents[2]

# The temporaries of one fp4 piece (2^18 values), allocated and freed 200 times on a worker
# thread as the all-reduce does; prints the minor page faults of the last 200 after a warm-up.
PROBE = """
import resource, sys, threading, torch
if sys.argv[1] == "tuned":
    from node.allocator import tune_malloc
    assert tune_malloc()
def work():
    x = torch.randn(1 << 18)
    for batch in range(2):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(200):
            a = x.abs(); b = x / 3.0; c = b.view(torch.int32) >> 22; d = c.to(torch.uint8); e = d[: 1 << 17].clone()
            del a, b, c, d, e
    print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
t = threading.Thread(target=work); t.start(); t.join()
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, timeout=90,
                         check=True)
    return int(out.stdout.strip())


def test_tuned_malloc_reuses_freed_temporaries_instead_of_faulting_them_in_again():
    default, tuned = faults("default"), faults("tuned")
    assert tuned * 10 < default, (tuned, default)  # ~0 against thousands: 200 x ~1.3 MB of fresh pages
