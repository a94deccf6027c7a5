"""The whole suite as a few pytest processes side by side: ``./scripts/test`` with no arguments.

Most of the suite's time is spent waiting: on node processes starting, on rounds of real swarms
whose steps wait as an accelerator would (``GONKA_TEST_STEP_SECONDS``, tests/integration/nodes.py),
on timeouts that detect a dead peer, on rate-limited links of the testbed. One pytest process
leaves the machine's cores idle for much of that time; a few of them, each with its own share of
the test files, fill it. (pytest-xdist would do the same per test; it is not a dependency.)

Files are shared out whole (a module's fixtures, such as the unit hostile tests' shared swarms,
stay in one process), longest first to the stream with the least work so far, by the wall
seconds each file took in one serial run on the 2-core development machine (``SECONDS``; a file
not listed counts ``DEFAULT``). The testbed's files run in one stream, one after the other: they
set up network namespaces. Each stream has its own ``--basetemp``; its output goes to a log that
is printed when the stream ends. The exit code is the first stream's that failed, else 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[1]
STREAMS = 3
DIRECTORIES = ("tests/unit", "tests/integration", "tests/testbed")
TOGETHER = ("tests/testbed",)  # directories whose files run in one stream, in order
DEFAULT = 2.0
# Wall seconds of the longer files (setup to teardown) in one run of the suite in streams: the
# files.json a run writes (2026-12-07, a fresh clone on the 2-core VM, 3 streams, 540 s).
SECONDS = {
    "tests/integration/test_faults.py": 257, "tests/integration/test_host_ranks.py": 187,
    "tests/integration/test_hostile.py": 133, "tests/testbed/test_wan_swarm.py": 112,
    "tests/integration/test_resume.py": 71, "tests/unit/test_hostile.py": 59,
    "tests/integration/test_overlap.py": 56, "tests/integration/test_heterogeneous.py": 51,
    "tests/integration/test_fingerprint.py": 48, "tests/testbed/test_testbed.py": 38,
    "tests/integration/test_hf_run.py": 38, "tests/integration/test_closed_swarm.py": 36,
    "tests/unit/test_simulator.py": 36, "tests/integration/test_swarm.py": 33, "tests/unit/test_rounds.py": 32,
    "tests/unit/test_hostile_conduct.py": 30, "tests/unit/test_parallel.py": 27,
    "tests/integration/test_simulator_matches.py": 27, "tests/unit/test_meeting.py": 24,
    "tests/integration/test_bad_model_input.py": 23, "tests/unit/test_export.py": 23,
    "tests/integration/test_operator.py": 23, "tests/unit/test_cli.py": 16, "tests/unit/test_prepare.py": 15,
    "tests/unit/test_data.py": 15, "tests/unit/test_outer.py": 14, "tests/unit/test_model.py": 10,
    "tests/unit/test_transfer.py": 10, "tests/unit/test_memory_modes.py": 10,
    "tests/integration/test_history.py": 9, "tests/unit/test_plan.py": 8, "tests/unit/test_signing.py": 8,
    "tests/testbed/test_wan.py": 7, "tests/unit/test_wire.py": 6, "tests/unit/test_presets.py": 6,
    "tests/integration/test_lifecycle.py": 4, "tests/unit/test_ledger_rounds.py": 4,
    "tests/unit/test_allocator.py": 4, "tests/unit/test_checkpoint.py": 3
}


def units() -> list[tuple[float, list[str]]]:
    """(seconds, files) of every unit of work: one test file, or a TOGETHER directory's files."""
    found = []
    for directory in DIRECTORIES:
        files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / directory).glob("test_*.py"))
        if directory in TOGETHER:
            found.append((sum(SECONDS.get(f, DEFAULT) for f in files), files))
        else:
            found += [(SECONDS.get(f, DEFAULT), [f]) for f in files]
    return found


def share(work: list[tuple[float, list[str]]], streams: int) -> list[list[str]]:
    """Longest first, each to the stream with the least seconds so far."""
    loads = [0.0] * streams
    files: list[list[str]] = [[] for _ in range(streams)]
    for seconds, unit in sorted(work, key=lambda w: (-w[0], w[1])):
        i = loads.index(min(loads))
        loads[i] += seconds
        files[i] += unit
    return [f for f in files if f]


def main() -> int:
    streams = share(units(), STREAMS)
    base = Path(tempfile.mkdtemp(prefix="gonka-tests-"))
    started = time.monotonic()
    procs = []
    # One intra-op thread per pytest process: with more processes than cores, an OpenMP team of
    # two waits for a core another process holds, and its threads spin at every barrier meanwhile
    # (test_simulator.py beside a busy process: 65 CPU-s with two threads, 41 with one, and faster).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for i, files in enumerate(streams):
        log = open(base / f"stream{i}.log", "wb")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=12",
               "--basetemp", str(base / f"s{i}"), "--junitxml", str(base / f"stream{i}.xml"), *files]
        procs.append((subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, env=env), log, i))
    print(f"{len(procs)} pytest processes side by side (tests/streams.py), logs in {base}", flush=True)

    def stop(signum, _frame):
        for proc, _, _ in procs:  # each pytest tears down its own tests' processes on SIGINT
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        signal.signal(signum, signal.SIG_DFL)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    code = 0
    pending = list(procs)
    while pending:
        for entry in list(pending):
            proc, log, i = entry
            if proc.poll() is None:
                continue
            pending.remove(entry)
            log.close()
            text = (base / f"stream{i}.log").read_text(errors="replace")
            lines = text.rstrip().splitlines()
            elapsed = time.monotonic() - started
            if proc.returncode == 0:
                print(f"stream {i} ({len(streams[i])} files) after {elapsed:.0f}s: {lines[-1] if lines else ''}",
                      flush=True)
            else:
                print(f"==== stream {i} failed (exit {proc.returncode}) after {elapsed:.0f}s: "
                      f"{' '.join(streams[i])}\n{text}", flush=True)
                code = code or proc.returncode
        time.sleep(0.5)
    print(f"suite: {time.monotonic() - started:.1f}s of tests in {len(procs)} streams, "
          f"{'all passed' if code == 0 else 'FAILED'}", flush=True)
    seconds = file_seconds(sorted(base.glob("stream*.xml")))
    if seconds:  # what ``SECONDS`` should say, from this run
        (base / "files.json").write_text(json.dumps(seconds, indent=1))
        top = ", ".join(f"{f.split('/')[-1]} {t:.0f}" for f, t in list(seconds.items())[:8])
        print(f"slowest files (s, setup to teardown; all in {base / 'files.json'}): {top}", flush=True)
    return code


def file_seconds(reports: list[Path]) -> dict[str, float]:
    """Seconds per test file (its tests' setup, call and teardown) from pytest's JUnit XML
    reports, longest first."""
    out: dict[str, float] = {}
    for report in reports:
        try:
            cases = ElementTree.parse(report).getroot().iter("testcase")
        except (OSError, ElementTree.ParseError):
            continue
        for case in cases:
            parts = case.get("classname", "").split(".")
            for n in range(len(parts), 0, -1):  # tests.unit.test_x[.TestClass]: the module's path
                path = "/".join(parts[:n]) + ".py"
                if (ROOT / path).is_file():
                    out[path] = out.get(path, 0.0) + float(case.get("time", 0) or 0)
                    break
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


if __name__ == "__main__":
    sys.exit(main())
