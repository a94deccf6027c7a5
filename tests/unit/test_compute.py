"""The trainer's thread keeps the intra-op threads; every other thread runs torch on one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import asyncio, json, threading, torch
from node.compute import ComputeThread

async def main():
    compute = ComputeThread(2)
    await compute.start()
    seen = {"compute": await compute(torch.get_num_threads), "loop": torch.get_num_threads()}
    seen["executor"] = await asyncio.to_thread(lambda: (torch.ones(1 << 20).add_(1), torch.get_num_threads())[1])
    later = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start(); t.join()
    seen["new thread"] = later[0]
    seen["compute again"] = await compute(torch.get_num_threads)
    compute.close()
    print(json.dumps(seen))

asyncio.run(main())
"""


@pytest.mark.timeout(60)
def test_only_the_compute_thread_gets_intra_op_threads():
    # In a child: thread counts are process-wide state the other tests should not inherit.
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen == {"compute": 2, "loop": 1, "executor": 1, "new thread": 1, "compute again": 2}
