"""One host's outer state through real rounds on loopback, its resident memory sampled: the part of
a host's RAM that a GPU host keeps there (``bench.py memory``, "outer state").

θ and the outer momentum (fp32, ``--params`` values in ``--tensors`` tensors, as a model's
parameters are) take the outer step (``trainer.outer.OuterOptimizer``, Nesterov) after each round
of the real round protocol (``p2p.rounds.RoundProtocol``: p2pd, DHT, streams, the lossy codec
with error feedback). The pseudo-gradient is made as a node makes it from a model on a GPU: one
tensor at a time, added into error feedback's vector where the round protocol offers it
(``delta_target``), else into a vector of its own, which the round takes (``donate=True``). No
model and no inner optimizer: what is measured is what the outer loop holds.

A thread samples this process's ``VmRSS`` and ``RssAnon`` every 10 ms; the peaks of each round
(from the pseudo-gradient to the end of the outer step) go to ``--workdir``/peer{index}.json with
the resident memory once θ and the momentum exist (``base``). With ``--state-dir`` θ, the
momentum, the residual and every round's Δ live in memory-mapped files (``outer.state_dir``,
trainer/hoststate.py): ``VmRSS`` then counts the files' resident pages, ``RssAnon`` not.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from allreduce_peer import abarrier, joined_rounds, peer0_addresses, tune_allocator, write_json  # noqa: E402


def rss(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class Sampler:
    """This process's peak RSS since the last ``reset``, sampled every 10 ms in a thread."""

    def __init__(self) -> None:
        self.peak = self.anon_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            self.anon_peak = max(self.anon_peak, rss("RssAnon"))
            time.sleep(0.01)

    def reset(self) -> tuple[int, int]:
        """(peak VmRSS, peak RssAnon) since the last reset."""
        peaks = (self.peak, self.anon_peak)
        self.peak, self.anon_peak = rss(), rss("RssAnon")
        return peaks

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def run(args, deadline: float) -> dict:
    from node.metrics import NodeMetrics
    from p2p.config import SwarmConfig
    from p2p.exchange import off_loop
    from p2p.swarm import Swarm
    from trainer.config import OuterConfig
    from trainer.outer import OuterOptimizer

    tune_allocator()
    workdir = Path(args.workdir)
    bootstrap = peer0_addresses(workdir, args.index, deadline)
    cfg = SwarmConfig(bootstrap=bootstrap, listen=["/ip4/127.0.0.1/tcp/0"], min_peers=args.peers,
                      heartbeat_interval=0.5, codec=args.codec, error_feedback=True)
    metrics = NodeMetrics()
    swarm = await Swarm.start(cfg, f"outer-memory-{args.run_tag}", identity_path=None,
                              on_reject=lambda reason: metrics.rejected_messages.labels(reason=reason).inc())
    sampler = Sampler()
    try:
        rounds = await joined_rounds(swarm, metrics, workdir, args.index, args.peers, deadline)
        sizes = [args.params // args.tensors + (1 if i < args.params % args.tensors else 0) for i in range(args.tensors)]
        gen = torch.Generator().manual_seed(args.index)
        scratch, momentum = None, None
        if args.state_dir:  # outer.state_dir: θ, m, the residual and Δ in memory-mapped files
            from trainer.hoststate import MappedState, views as mapped_views

            state = MappedState(str(Path(args.state_dir) / f"peer{args.index}"))
            theta = mapped_views(state.vector("theta", args.params), [(n,) for n in sizes])
            for t in theta:
                t.normal_(generator=gen)
            momentum = mapped_views(state.vector("momentum", args.params), [(n,) for n in sizes])
            scratch = rounds.plane.scratch = state.scratch
        else:
            theta = [torch.randn(n, generator=gen) for n in sizes]
        outer = OuterOptimizer(theta, OuterConfig(lr=0.7, momentum=0.9, nesterov=True), momentum)
        base = rss()
        sampler.reset()
        peaks = []
        for r in range(args.rounds):
            await abarrier(workdir, f"round{r}", args.index, args.peers, deadline)
            target = getattr(rounds, "delta_target", lambda: None)()

            def pseudo_gradient():
                flat = target if target is not None else (
                    scratch(args.params) if scratch is not None else torch.empty(args.params))
                views, at = [], 0
                for n in sizes:  # one tensor at a time, as from a model on a GPU
                    step = torch.randn(n, generator=gen).mul_(1e-3)
                    view = flat[at : at + n]
                    view.copy_(step) if target is None else view.add_(step)
                    views.append(view)
                    at += n
                return views

            delta = await off_loop(pseudo_gradient)
            avg = await rounds.average(delta, 1.0, r, donate=True)
            if avg is None:
                raise RuntimeError(f"round {r} did not commit: {rounds.last}")
            await off_loop(outer.step, avg)
            del avg, delta
            swarm.announce(state="training", round=r + 1, hash="")
            peaks.append(sampler.reset())
        await abarrier(workdir, "done", args.index, args.peers, deadline)
        return {"base": base, "peaks": [p for p, _ in peaks], "anon_peaks": [a for _, a in peaks]}
    finally:
        sampler.stop()
        await swarm.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--workdir", required=True)
    p.add_argument("--params", type=int, required=True)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--codec", default="int8")
    p.add_argument("--run-tag", default="0")
    p.add_argument("--state-dir", default="", help="θ, momentum, residual and Δ in memory-mapped files under DIR")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    torch.set_num_threads(1)
    import uvloop

    result = uvloop.run(run(args, time.time() + args.timeout - 5))
    write_json(Path(args.workdir) / f"peer{args.index}.json", {"index": args.index, "params": args.params, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
