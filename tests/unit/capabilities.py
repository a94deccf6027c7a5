"""Bits compared across CPU capabilities: scripts run in child processes, one per
ATEN_CPU_CAPABILITY this CPU has, and their values compared.

Test modules register a script with ``section(name, script)`` when they are imported (the
script fills a dict ``out`` with named values); the first test that asks for results runs every
section registered by then in one child per capability, the children side by side, so the suite
pays torch's start-up once per capability rather than once per test module."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 150.0
# The capabilities torch can be told to use on a CPU whose best one is the key, weakest first.
LADDERS = {"default": ("default",), "avx2": ("default", "avx2"), "avx512": ("default", "avx2", "avx512")}

_sections: dict[str, str] = {}
_results: dict[str, dict[str, dict]] = {}  # section -> capability -> values


def section(name: str, script: str) -> str:
    """Register ``script`` (it leaves its values in a dict named ``out``) under ``name``."""
    assert _sections.get(name, script) == script, f"two scripts named {name}"
    _sections[name] = script
    return name


def _run_children(script: str, envs: dict[str, dict[str, str]]) -> dict[str, str]:
    """stdout of ``python -c script`` under each of ``envs``, the children run side by side (each
    pays torch's start-up; one after the other they cost the sum of it); every child (and anything
    it started) dies with the test."""
    procs = {key: subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
             for key, env in envs.items()}
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    out = {}
    try:
        for key, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            assert proc.returncode == 0, f"child failed under {envs[key].get('ATEN_CPU_CAPABILITY')}:\n{stderr[-3000:]}"
            out[key] = stdout
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return out


def _child_env(capability: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["GONKA_NATIVE"] = "0"  # no C build in a child; the kernels do not follow ATEN_CPU_CAPABILITY anyway
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    return env


@functools.lru_cache(maxsize=None)
def capabilities() -> tuple[str, ...]:
    """'default' up to the capability torch picks on this CPU by itself (asking for more than the
    CPU has would crash the child with an illegal instruction)."""
    if "ATEN_CPU_CAPABILITY" in os.environ:  # this process was told one: ask a child left to pick
        script = "import torch; print(torch.backends.cpu.get_cpu_capability())"
        best = _run_children(script, {"": _child_env(None)})[""].strip().lower()
    else:
        import torch

        best = torch.backends.cpu.get_cpu_capability().lower()
    return LADDERS.get(best, ("default", best))


def _child_script(names: list[str]) -> str:
    # The alarm ends a child that outlives its test (as it would if pytest itself were killed).
    lines = [f"import json, os, signal, traceback, torch\nsignal.alarm({int(CHILD_TIMEOUT_S) + 30})",
             "assert torch.backends.cpu.get_cpu_capability().lower() == os.environ['ATEN_CPU_CAPABILITY']",
             "results = {}"]
    for name in names:  # a section that fails fails its own tests, not the others'
        lines += [f"scope = {{'__name__': {name!r}}}",
                  "try:",
                  f"    exec(compile({_sections[name]!r}, {name!r}, 'exec'), scope)",
                  f"    results[{name!r}] = scope['out']",
                  "except Exception:",
                  f"    results[{name!r}] = {{'__error__': traceback.format_exc()}}"]
    lines.append("print(json.dumps(results))")
    return "\n".join(lines) + "\n"


def by_capability(name: str) -> dict[str, dict]:
    """Section ``name``'s values per capability; skips the test where the CPU has only one."""
    caps = capabilities()
    if len(caps) < 2:
        pytest.skip(f"this CPU runs only ATEN_CPU_CAPABILITY={caps[0]}: nothing to compare")
    if name not in _results:
        pending = [n for n in _sections if n not in _results]
        script = _child_script(pending)
        stdout = _run_children(script, {cap: _child_env(cap) for cap in caps})
        by_cap = {cap: json.loads(stdout[cap].splitlines()[-1]) for cap in caps}
        for n in pending:
            _results[n] = {cap: by_cap[cap][n] for cap in caps}
    for cap, values in _results[name].items():
        assert "__error__" not in values, f"section {name} failed under {cap}:\n{values['__error__'][-3000:]}"
    return _results[name]


def assert_same_everywhere(values: dict[str, dict], prefix: str = "") -> None:
    """Every capability's values equal the first one's (those whose keys start with ``prefix``)."""
    values = {cap: {k: v for k, v in got.items() if k.startswith(prefix)} for cap, got in values.items()}
    (first, expected), *rest = values.items()
    assert expected, f"no values named {prefix}*"
    for cap, got in rest:
        differ = sorted(k for k in expected if got.get(k) != expected[k])
        assert not differ, f"{cap} differs from {first} in {differ}"
