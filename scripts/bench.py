"""Benchmark runner: ``python scripts/bench.py NAME [--quick] [--out DIR] [options of NAME]``.

Runs one benchmark from the registry in ``scripts/benchmarks/__init__.py``,
writes its result to DIR/NAME.json (default runs/bench) and prints its rows as
a table. A benchmark is a callable ``run(args) -> dict``; the dict's ``rows``
(a list of flat dicts) are the table, ``columns`` optionally orders them, and
every other key is kept in the JSON as is. ``--quick`` asks for a smaller,
faster run meant as a smoke test, not for numbers to quote; ``--smoke`` (which
implies ``--quick``) the smallest run that still fills every row of the table,
toy sizes and seconds each, which CI runs after the suite (tests/smoke/test_bench_smoke.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
from benchmarks import ARGUMENTS, BENCHMARKS  # noqa: E402


def build_parser(name: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", metavar="NAME", help=f"benchmark to run: {', '.join(BENCHMARKS)}")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (a smoke run)")
    p.add_argument("--smoke", action="store_true",
                   help="toy sizes, every row of the table, seconds each: what the tests run (implies --quick; "
                        "the figures mean nothing)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench", help="directory for NAME.json (default: runs/bench)")
    if name in ARGUMENTS:
        ARGUMENTS[name](p.add_argument_group(f"{name} options"))
    return p


def format_cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(rows: list[dict], columns: list[str] | None) -> None:
    if not rows:
        return
    columns = columns or list(rows[0])
    cells = [columns] + [[format_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))


def write_json(path: Path, result: dict) -> None:
    """Write via a temporary file and rename, so a crash never leaves half a result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Find NAME first: its options must be known before the full parse, and an
    # unknown name gets one line instead of a usage dump.
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("name", nargs="?")
    name = first.parse_known_args(argv)[0].name
    if name is not None and name not in BENCHMARKS:
        print(f"bench.py: unknown benchmark {name!r} (choose from {', '.join(BENCHMARKS)})", file=sys.stderr)
        return 2
    args = build_parser(name).parse_args(argv)
    args.quick = args.quick or args.smoke

    started = time.time()
    result = BENCHMARKS[args.name](args)
    record = {
        "benchmark": args.name,
        "quick": args.quick,
        "smoke": args.smoke,
        "command": " ".join([Path(sys.argv[0]).name, *argv]),
        "started_unix": round(started, 3),
        "seconds": round(time.time() - started, 3),
        "host": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()},
        **result,
    }
    path = args.out / f"{args.name}.json"
    write_json(path, record)
    print_table(result.get("rows", []), result.get("columns"))
    for note in result.get("notes", []):
        print(note)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
