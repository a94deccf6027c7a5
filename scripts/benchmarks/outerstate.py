"""Benchmark ``outerstate``: the outer step with θ and the momentum in RAM or in memory-mapped
files (``outer.state_dir``, trainer/hoststate.py): host memory and seconds per GB, side by side.

Each mode runs in a child process of its own (a clean RSS, the modes alternated ``--runs``
times): θ of ``--params`` values in tensors of ``--tensor`` values (as a model's layers), its
momentum, then ``--steps`` outer steps (``trainer.outer.OuterOptimizer``, Nesterov) with a
pseudo-gradient read one tensor at a time, as the outer step reads a round's
``CommittedAverage``. A thread samples the child's ``RssAnon`` and ``RssFile`` every 10 ms.

Per mode, medians over the runs: ``anon_peak_GB``, the anonymous memory at its peak (what the
host must hold: θ and m in RAM mode; a tensor of Δ and the step's temporaries on disk);
``file_peak_GB``, what of the mapping was resident (page cache, which the kernel reclaims under
pressure); ``step_s``, one outer step's seconds (the first step excluded: it creates the
momentum); ``GB_per_s``, θ and m stepped per second (each read and written once).
``--cold`` drops the page cache before every step (root): the mapped mode then reads its files
from the disk, as a host whose RAM holds less than the state does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ["mode", "params", "state_GB", "anon_peak_GB", "file_peak_GB", "step_s", "GB_per_s"]


def add_arguments(group) -> None:
    group.add_argument("--params", type=int, help="values of θ (default 250M: 2 GB of θ and m; 1M with --smoke)")
    group.add_argument("--tensor", type=int, default=1 << 24, help="values per tensor (default 16M, a large layer)")
    group.add_argument("--steps", type=int, help="outer steps per run, the first not timed (default 4; 3 with --smoke)")
    group.add_argument("--runs", type=int, help="runs of each mode, alternated (default 3; 1 with --smoke)")
    group.add_argument("--dir", help="directory for the mapped files (default: a new one under /var/tmp)")
    group.add_argument("--cold", action="store_true", help="drop the page cache before every step (root)")


def _memory() -> tuple[int, int]:
    anon = file = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            anon = int(line.split()[1]) * 1024
        elif line.startswith("RssFile:"):
            file = int(line.split()[1]) * 1024
    return anon, file


def child(spec: dict) -> dict:
    """One run of one mode, in this process."""
    import torch

    sys.path.insert(0, str(ROOT))
    from trainer.config import OuterConfig
    from trainer.hoststate import MappedState, views
    from trainer.outer import OuterOptimizer

    torch.set_num_threads(1)
    peak = {"anon": 0, "file": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            anon, file = _memory()
            peak["anon"], peak["file"] = max(peak["anon"], anon), max(peak["file"], file)
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    n, size = spec["params"], spec["tensor"]
    shapes = [(min(size, n - at),) for at in range(0, n, size)]
    if spec["mode"] == "disk":
        state = MappedState(spec["dir"])
        theta = views(state.vector("theta", n), shapes)
        momentum = views(state.vector("momentum", n), shapes)
    else:
        theta, momentum = [torch.empty(s) for s in shapes], None
    g = torch.Generator().manual_seed(0)
    for t in theta:
        t.normal_(generator=g)
    delta = torch.randn(size, generator=g) * 1e-3
    opt = OuterOptimizer(theta, OuterConfig(), momentum)
    times = []
    for step in range(spec["steps"]):
        if spec["cold"]:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        started = time.perf_counter()
        opt.step([delta[: t.numel()] for t in theta])
        times.append(time.perf_counter() - started)
    stop.set()
    sampler.join()
    return {"times": times[1:], "anon": peak["anon"], "file": peak["file"]}


def run(args: argparse.Namespace) -> dict:
    smoke = getattr(args, "smoke", False)
    params = args.params or (1_000_000 if smoke else 250_000_000)
    steps = max(2, args.steps or (3 if smoke else 4))
    runs = args.runs or (1 if smoke else 3)
    if params < 1 or args.tensor < 1:
        raise ValueError("--params and --tensor must be >= 1")
    if args.cold and os.geteuid() != 0:
        raise ValueError("--cold: dropping the page cache needs root")
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="outerstate-", dir="/var/tmp"))
    results: dict[str, list[dict]] = {"ram": [], "disk": []}
    try:
        for r in range(runs):
            for mode in ("ram", "disk"):
                spec = {"mode": mode, "params": params, "tensor": args.tensor, "steps": steps, "cold": args.cold,
                        "dir": str(base / f"{mode}{r}")}
                out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], check=True,
                                     capture_output=True, text=True, timeout=3600)
                results[mode].append(json.loads(out.stdout.splitlines()[-1]))
                for f in (base / f"{mode}{r}").glob("*.f32"):
                    f.unlink()
    finally:
        if not args.dir:
            for d in base.glob("*"):
                for f in d.glob("*"):
                    f.unlink()
                d.rmdir()
            base.rmdir()
    state_gb = params * 8 / 1e9
    rows = []
    for mode, got in results.items():
        step = statistics.median(t for r in got for t in r["times"])
        rows.append({"mode": mode, "params": params, "state_GB": state_gb,
                     "anon_peak_GB": statistics.median(r["anon"] for r in got) / 1e9,
                     "file_peak_GB": statistics.median(r["file"] for r in got) / 1e9,
                     "step_s": step, "GB_per_s": state_gb / step})
    ram, disk = rows
    notes = [f"θ and m on disk: anonymous peak {disk['anon_peak_GB']:.2f} GB against {ram['anon_peak_GB']:.2f} GB in "
             f"RAM; an outer step {disk['step_s'] / ram['step_s']:.2f}x the in-RAM time"
             f"{' (page cache dropped before every step)' if args.cold else ' (page cache warm)'}"]
    return {"rows": rows, "columns": COLUMNS, "notes": notes,
            "config": {"params": params, "tensor": args.tensor, "steps": steps, "runs": runs, "cold": args.cold}}


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--child":
    print(json.dumps(child(json.loads(sys.argv[2]))))
