"""Registry of benchmarks run by ``scripts/bench.py``.

``BENCHMARKS`` maps a name to ``run(args) -> dict`` (see bench.py for what
the dict holds); ``ARGUMENTS`` maps the same name to a hook that adds the
benchmark's own command-line options to an argparse group. To add a
benchmark, write ``scripts/benchmarks/NAME.py`` with ``run`` and
``add_arguments`` and add NAME to ``NAMES``.

A benchmark's module is imported when it is first called, not here: ``bench.py
NAME`` then imports NAME's dependencies only, and so do the processes a
benchmark starts with multiprocessing's spawn (they import bench.py again).
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any, Callable

NAMES = ("aggregate", "allreduce", "checks", "codecs", "convergence", "dataloader", "gpu", "hostranks", "join", "killed",
         "memory", "outerstate", "overhead", "planfit", "prepare", "scale", "sweep", "trust", "utilization")


def _lazy(name: str, attr: str) -> Callable[..., Any]:
    """``benchmarks.NAME.attr``, imported on the first call."""

    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(f"{__name__}.{name}"), attr)(*args)

    call.__name__ = call.__qualname__ = f"{name}.{attr}"
    return call


BENCHMARKS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {n: _lazy(n, "run") for n in NAMES}
ARGUMENTS: dict[str, Callable[[Any], None]] = {n: _lazy(n, "add_arguments") for n in NAMES}
