"""Checks of scripts/bench.py that run nothing: every benchmark has a smoke spec
(tests/smoke/test_bench_smoke.py, which CI runs after the suite), and no function of
scripts/bench.py and scripts/benchmarks/ reads a global name nobody defines (issue 32: the
hivemind and gloo rows of ``allreduce`` died with a NameError for weeks; caught here statically)."""

from __future__ import annotations

import builtins
import symtable
from pathlib import Path

import pytest

from tests.smoke.test_bench_smoke import GROUPS, NAMES, SCRIPTS, SECONDS, SPECS

BENCH_SOURCES = sorted([SCRIPTS / "bench.py", *(SCRIPTS / "benchmarks").glob("*.py")])


@pytest.mark.timeout(10)
def test_every_benchmark_has_a_smoke_test():
    assert sorted(n for names in GROUPS.values() for n in names) == sorted(NAMES) == sorted(SPECS) == sorted(SECONDS)


# ---- no function reads a name nobody defines -----------------------------------------------

MODULE_NAMES = {"__file__", "__name__", "__doc__", "__spec__", "__loader__", "__package__", "__builtins__", "__path__"}


def undefined_globals(path: Path) -> list[str]:
    """Names a function (or class body) of ``path`` reads as globals that the module never binds
    (by assignment, def, class or import) and that are not builtins."""
    top = symtable.symtable(path.read_text(), str(path), "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    defined |= set(dir(builtins)) | MODULE_NAMES
    found = []

    def walk(table) -> None:
        for child in table.get_children():
            for sym in child.get_symbols():
                if sym.is_global() and sym.is_referenced() and not sym.is_assigned() and sym.get_name() not in defined:
                    found.append(f"{path.name}: {child.get_name()}() reads {sym.get_name()}")
            walk(child)

    walk(top)
    return found


@pytest.mark.timeout(30)
def test_no_benchmark_reads_an_undefined_name():
    assert [f for path in BENCH_SOURCES for f in undefined_globals(path)] == []


@pytest.mark.timeout(30)
def test_the_undefined_name_check_sees_a_name_read_before_it_is_bound(tmp_path):
    bad = tmp_path / "peer.py"
    bad.write_text("import time\n\ndef run():\n    t_exit = time.time()\n    return {'t_commit': t_commit, 't_exit': t_exit}\n")
    assert undefined_globals(bad) == ["peer.py: run() reads t_commit"]
