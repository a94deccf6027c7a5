"""The one thread that runs the trainer's heavy torch work with several intra-op threads.

torch's CPU ops run on OpenMP, and every thread that enters a parallel region
gets a team of its own. Once the teams of all threads together hold more
threads than the host has cores, libgomp stops spinning at its barriers and
sleeps instead, and every parallel op of the trainer pays a wake-up: measured
on 2 cores, inner steps ran 15-25% slower in a worker thread when the main
thread had once run one parallel op than when nothing else had.

So the node gives ``node.threads`` intra-op threads to this one thread, which
runs the inner steps, the pseudo-gradient, evaluation and the outer step
between rounds; every other thread (the event loop, the all-reduce's tensor
thread, asyncio's executor) runs torch single-threaded and never makes a team.
torch keeps the thread count per thread once a thread has used it, and new
threads start from the last value set anywhere, hence the order in ``start``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools

import torch


def _claim_threads(threads: int) -> int:
    if threads:
        torch.set_num_threads(threads)
    # One parallel op makes this thread's team now, at this size.
    torch.ones(1 << 20).add_(1.0)
    return torch.get_num_threads()


class ComputeThread:
    """Run blocking trainer calls on the one multi-threaded torch thread: ``await compute(fn, *args)``."""

    def __init__(self, threads: int) -> None:
        # threads: intra-op threads of the trainer; 0 = torch's default (one per core).
        self._threads = threads
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gonka-train")
        self.threads = 0  # what the trainer got, once started

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.threads = await loop.run_in_executor(self._executor, _claim_threads, self._threads)
        # From now on this thread (the event loop's) and every thread that first uses torch
        # later runs torch ops on one thread.
        torch.set_num_threads(1)

    async def __call__(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Wait for the call in progress, if any (it is told to stop by its caller), and end the thread."""
        self._executor.shutdown(wait=True)
