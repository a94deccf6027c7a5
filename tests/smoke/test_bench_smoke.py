"""Every benchmark of scripts/bench.py still runs: its smoke mode fills every row with figures.

``bench.py NAME --smoke`` (implies ``--quick``) runs a benchmark at toy sizes with every
system of its side-by-side table (gonka-node, hivemind and gloo; node and bare loop; every
aggregator, overlap mode, rank count...). The figures mean nothing; what is checked is that
every row has them: numbers, finite, above zero where they are times or rates, and every
system in the table. A benchmark nobody ran for a while fails here instead of at the next
measurement (issue 32: the hivemind and gloo rows of ``allreduce`` died with a NameError for
weeks).

Benchmarks run in groups, each group in one Python process that calls ``bench.main`` once per
benchmark: one interpreter start and one torch/transformers import per group instead of per
benchmark. The groups' processes start together, at the first smoke test: the testbed's
benchmarks spend much of their time on rate-limited links and timeouts, which the other groups'
CPU work fills. A benchmark that fails is caught and reported by its own test with the group
log's tail (each benchmark's wall and CPU seconds are in the log). The testbed groups (network
namespaces) need root and iproute2 and skip otherwise.

Every benchmark's smoke runs in every run of the suite (issue 32: CI runs each smoke mode), so
the smoke sizes are the smallest that still fill every row: the benchmarks that start several
`gonka-node` processes cost tens of seconds each even so, most of it the nodes' start-up.

The smokes are not part of ``./scripts/test`` (the suite, kept under 8 minutes on 2 cores); CI
(``.ci/run``) runs them after it, as ``./scripts/test tests/smoke``. What needs no run (every
benchmark has a smoke spec, no benchmark reads an undefined name) is checked in the suite:
tests/unit/test_bench_sources.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"

sys.path.insert(0, str(SCRIPTS))
from benchmarks import NAMES  # noqa: E402

HAVE_TESTBED = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# name -> what every row must hold:
#   positive: numbers > 0 (times, rates, sizes); finite: numbers, finite, any sign;
#   systems: (column, values): the rows must cover exactly these values of that column.
SPECS: dict[str, dict] = {
    "trust": dict(positive=["median_us", "p90_us", "per_second"],
                  systems=("operation", {"sign", "verify_first", "verify_known_key", "verify_repeat", "cert_check",
                                         "table_read_8"})),
    "codecs": dict(positive=["wire_MB", "ratio_vs_fp32", "encode_s", "decode_s", "send_1gbit_s", "speedup_vs_1gbit"],
                   finite=["rel_error"], systems=("codec", {"fp32", "fp16", "bf16", "int8", "int4", "fp4", "sparse",
                                                             "sparse/average", "sparse-k128", "sparse-k128/average"})),
    "aggregate": dict(positive=["seconds", "eval_loss", "rounds_run"],
                      systems=("aggregator", {"mean", "clip", "centered_clip"})),
    "convergence": dict(positive=["eval_loss", "tokens"],
                        systems=("run", {"diloco", "ddp", "single", "diloco fp4 + error feedback",
                                         "diloco fp4, no feedback", "diloco, eager overlap",
                                         "diloco, bf16 inner loop", "diloco, 8bit inner loop",
                                         "diloco, bf16+8bit inner loop", "diloco sparse + SparseLoCo step"})),
    "checks": dict(positive=["members", "checks"], systems=("kind", {"fast", "slow", "shirk", "replay", "free_ride",
                                                                     "noise"})),
    "sweep": dict(positive=["eval_loss", "x_fp32", "bytes_each_way"], systems=("codec", {"fp32", "sparse"})),
    "dataloader": dict(positive=["batches", "samples_s", "Mtokens_s", "rss_start_MB", "rss_end_MB", "rss_peak_MB"],
                       finite=["rss_growth_MB"], systems=("source", {"mmap", "in_memory"})),
    "prepare": dict(positive=["tokens", "prepare_tok_s", "bare_tok_s", "bare_fast_tok_s", "ratio", "prepare_s"],
                    systems=("processes", {1, 2})),
    "scale": dict(positive=["round_s", "gather_s", "allreduce_s", "lookup_ms", "startup_s", "rss_mb"],
                  systems=("peers", {2, 3}), true=["all_committed"]),
    "overhead": dict(positive=["node_tokens_per_s", "bare_tokens_per_s", "ratio"]),
    "gpu": dict(positive=["node_tokens_per_s", "bare_tokens_per_s", "ratio"]),
    "memory": dict(positive=["params", "round_peak_mb"], systems=("ranks", {1, 2})),
    "planfit": dict(positive=["rank1_mb", "rank0_mb", "plan_mb", "rank1_ratio"], systems=("mode", {"bf16+8bit"})),
    "outerstate": dict(positive=["params", "state_GB", "anon_peak_GB", "file_peak_GB", "step_s", "GB_per_s"],
                       systems=("mode", {"ram", "disk"})),
    "allreduce": dict(positive=["seconds", "commit_s", "allreduce_s", "bound_seconds", "ratio_to_bound",
                                "nic_tx_bytes_per_peer"],
                      finite=["rel_error"], systems=("system", {"gonka-node", "hivemind", "gloo"}),
                      true=["within_tol"]),
    "join": dict(positive=["seconds", "bound_seconds", "ratio_to_bound", "start_to_synced_s", "state_bytes"]),
    "killed": dict(positive=["normal_s", "killed_round_s", "members"], finite=["extra_s"]),
    "utilization": dict(positive=["utilization", "train_seconds", "wall_seconds", "step_ms", "allreduce_s"],
                        systems=("overlap", {"off", "eager"})),
    "hostranks": dict(positive=["allreduce_s", "bound_s", "ratio"], systems=("ranks", {1, 2})),
}

# Groups, each one process, in this order.
GROUPS: dict[str, list[str]] = {
    # In-process work and a few short-lived children each.
    "cpu": ["codecs", "trust", "aggregate", "checks", "convergence", "sweep", "dataloader", "prepare", "scale", "outerstate"],
    # Several gonka-node (or bare training loop) processes each.
    "nodes": ["overhead", "gpu", "memory", "planfit"],
    # The testbed (network namespaces): root only. Two groups side by side: their benchmarks mostly
    # wait on links and nodes, and each testbed's namespaces carry the pid of its group's process.
    "testbed": ["utilization", "allreduce"],
    "testbed2": ["hostranks", "killed", "join"],
}
TESTBED_GROUPS = {"testbed", "testbed2"}
# Smoke wall seconds on the 2-core development machine, load average 1-2 (5-7: up to twice
# that), one group at a time: the time limit is 4 times their sum, plus a start-up.
SECONDS = {"codecs": 1, "trust": 1, "checks": 6, "outerstate": 4, "aggregate": 7, "convergence": 25, "sweep": 5, "dataloader": 5, "prepare": 3, "scale": 6,
           "overhead": 14, "gpu": 16, "memory": 85, "planfit": 25, "allreduce": 17, "killed": 19, "join": 32,
           "utilization": 40, "hostranks": 45}


def extra_options(name: str) -> list[str]:
    if name == "gpu" and not _cuda():
        return ["--device", "cpu"]  # the CPU smoke: the same node and bare FSDP loop, tiny model
    return []


DRIVER = r"""
import json, resource, sys, time, traceback
scripts, out, names, extras, record = sys.argv[1], sys.argv[2], sys.argv[3].split(","), json.loads(sys.argv[4]), sys.argv[5]
sys.path.insert(0, scripts)
import bench

def cpu():  # this process and the children it waited for
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))

results = {}
for name in names:
    print(f"==== {name}", flush=True)
    started, cpu_started = time.monotonic(), cpu()
    try:
        code = bench.main([name, "--smoke", "--out", out, *extras.get(name, [])])
        error = None if code == 0 else f"bench.main returned {code}"
    except SystemExit as e:
        error = f"SystemExit({e.code!r})"
    except BaseException:
        error = traceback.format_exc()
    results[name] = {"seconds": round(time.monotonic() - started, 2), "cpu_seconds": round(cpu() - cpu_started, 2),
                     "error": error}
    print(f"==== {name}: {results[name]['seconds']} s ({results[name]['cpu_seconds']} CPU-s)"
          f"{'' if error is None else ' FAILED'}", flush=True)
    with open(record, "w") as f:
        json.dump(results, f)
"""


def smoke_timeout() -> int:
    """Seconds a group's process may take from its start, the groups that run all counted: they
    run together and share the machine. A group's first test waits for it that long at most."""
    return 30 + 4 * sum(SECONDS[n] for group, names in GROUPS.items() if group not in TESTBED_GROUPS or HAVE_TESTBED
                        for n in names)


class Groups:
    """The groups' processes, all started together the first time a smoke test needs one: a
    testbed benchmark spends much of its time waiting on rate-limited links and timeouts, which
    the others' CPU work fills (issue 32: the suite's budget). Each test then waits for its own
    group; whatever is still running at the end of the session is stopped."""

    def __init__(self, tmp_factory, wanted: list[str]):
        self.tmp_factory, self.wanted = tmp_factory, wanted
        self.running: dict[str, tuple[subprocess.Popen, Path, float]] = {}
        self.done: dict[str, tuple[Path, dict, str]] = {}

    def start(self) -> None:
        for group in self.wanted:
            if group in self.running or group in self.done:
                continue
            work = self.tmp_factory.mktemp(f"bench-smoke-{group}")
            names = GROUPS[group]
            extras = {n: extra_options(n) for n in names}
            started = time.monotonic()
            with open(work / "log.txt", "wb") as log:
                # A session of its own: on a time-out the whole group gets SIGTERM first, so that a
                # testbed tears itself down (netbed handles it) before anything is killed.
                proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(SCRIPTS), str(work / "out"), ",".join(names),
                                         json.dumps(extras), str(work / "record.json")], cwd=ROOT, stdout=log,
                                        stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                        start_new_session=True)
            self.running[group] = (proc, work, started)

    def result(self, group: str) -> tuple[Path, dict, str]:
        """(out dir, per-benchmark record, log) of the group, waiting for it to end."""
        if group not in self.done:
            self.start()
            proc, work, started = self.running.pop(group)
            limit = smoke_timeout() - 30
            try:
                proc.wait(max(1.0, started + limit - time.monotonic()))
            except subprocess.TimeoutExpired:
                with open(work / "log.txt", "ab") as log:
                    log.write(f"\n==== group {group} timed out after {limit} s\n".encode())
                self._stop(proc)
            record = work / "record.json"
            results = json.loads(record.read_text()) if record.exists() else {}
            self.done[group] = (work / "out", results, (work / "log.txt").read_text(errors="replace"))
        return self.done[group]

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def close(self) -> None:
        for proc, _, _ in self.running.values():
            if proc.poll() is None:
                self._stop(proc)


@pytest.fixture(scope="module")
def groups(request, tmp_path_factory):
    """The smoke groups this session selected (``-k`` may pick a few): started together on first use."""
    wanted = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.module is request.module and spec and "group" in spec.params and not item.get_closest_marker("skip"):
            if spec.params["group"] not in wanted:
                wanted.append(spec.params["group"])
    runs = Groups(tmp_path_factory, wanted)
    yield runs
    runs.close()


def log_of(name: str, log: str) -> str:
    """The part of a group's log that one benchmark wrote, its last 60 lines."""
    part = log.partition(f"==== {name}\n")[2] or log
    return "\n".join(part.partition("\n==== ")[0].splitlines()[-60:])


def check_rows(name: str, result: dict) -> None:
    spec = SPECS[name]
    rows = result.get("rows")
    assert rows, f"{name}: no rows"
    for row in rows:
        where = f"{name} row {json.dumps({k: v for k, v in row.items() if not isinstance(v, (list, dict))})}"
        assert "error" not in row, where
        for key in spec.get("positive", []):
            value = row.get(key)
            assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{where}: {key} is {value!r}"
            assert math.isfinite(value) and value > 0, f"{where}: {key} = {value!r}, not a finite number > 0"
        for key in spec.get("finite", []):
            value = row.get(key)
            assert isinstance(value, (int, float)) and math.isfinite(value), f"{where}: {key} = {value!r}"
        for key in spec.get("true", []):
            assert row.get(key) is True, f"{where}: {key} = {row.get(key)!r}"
    if "systems" in spec:
        column, expected = spec["systems"]
        assert {row.get(column) for row in rows} == expected, f"{name}: rows cover {column} {[r.get(column) for r in rows]}"


def smoke_params():
    for group, names in GROUPS.items():
        for name in names:
            marks = [pytest.mark.timeout(smoke_timeout())]
            if group in TESTBED_GROUPS and not HAVE_TESTBED:
                marks.append(pytest.mark.skip(reason="the testbed needs root and iproute2 (ip, tc)"))
            yield pytest.param(group, name, marks=marks, id=name)


@pytest.mark.parametrize("group, name", list(smoke_params()))
def test_smoke_run_fills_every_row(group, name, groups):
    out, results, log = groups.result(group)
    got = results.get(name)
    assert got is not None, f"{name} did not finish; log:\n{log_of(name, log)}"
    assert got["error"] is None, f"{name} failed after {got['seconds']} s: {got['error']}\nlog:\n{log_of(name, log)}"
    result = json.loads((out / f"{name}.json").read_text())
    assert result["smoke"] and result["quick"]
    check_rows(name, result)
