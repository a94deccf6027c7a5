"""Registry of benchmarks run by ``scripts/bench.py``.

``BENCHMARKS`` maps a name to ``run(args) -> dict`` (see bench.py for what
the dict holds); ``ARGUMENTS`` optionally maps the same name to a hook that
adds the benchmark's own command-line options to an argparse group. To add a
benchmark, write ``scripts/benchmarks/NAME.py`` with ``run`` (and
``add_arguments`` if it has options) and register both here.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from . import (aggregate, allreduce, codecs, convergence, dataloader, gpu, hostranks, join, killed, memory, overhead,
               prepare, scale, trust, utilization)

BENCHMARKS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "aggregate": aggregate.run,
    "allreduce": allreduce.run,
    "codecs": codecs.run,
    "convergence": convergence.run,
    "dataloader": dataloader.run,
    "gpu": gpu.run,
    "hostranks": hostranks.run,
    "join": join.run,
    "killed": killed.run,
    "memory": memory.run,
    "overhead": overhead.run,
    "prepare": prepare.run,
    "scale": scale.run,
    "trust": trust.run,
    "utilization": utilization.run,
}

ARGUMENTS: dict[str, Callable[[Any], None]] = {
    "aggregate": aggregate.add_arguments,
    "allreduce": allreduce.add_arguments,
    "codecs": codecs.add_arguments,
    "convergence": convergence.add_arguments,
    "dataloader": dataloader.add_arguments,
    "gpu": gpu.add_arguments,
    "hostranks": hostranks.add_arguments,
    "join": join.add_arguments,
    "killed": killed.add_arguments,
    "memory": memory.add_arguments,
    "overhead": overhead.add_arguments,
    "prepare": prepare.add_arguments,
    "scale": scale.add_arguments,
    "trust": trust.add_arguments,
    "utilization": utilization.add_arguments,
}
