"""Fault injection for tests: a node SIGKILLs itself at a chosen point of a chosen round.

Set ``GONKA_TEST_FAULT=PHASE@ROUND[:MEMBERS]`` in a node's environment: the node
dies at the first PHASE of round ROUND or later (the round being averaged, i.e.
the committed round + 1) in a group of at least MEMBERS peers. Phases:

- ``grouped``: the group is agreed, before this member sent anything;
- ``reduce``: its slices are sent, before any averaged part came back;
- ``gather``: it holds some averaged parts, not all;
- ``commit``: every vote is in and agrees, before the outer step is applied;
- ``serve``: a peer asked it for a piece of the state, before it answered.

With ``/stop`` after it (``reduce@4:4/stop``) the node SIGSTOPs itself there instead:
it hangs with every connection open, and a testbed that then cuts its link has a
host gone from the network without closing anything (scripts/benchmarks/killed.py
``--how drop``): its peers learn of it only from their deadlines.

``GONKA_TEST_HOLD_FIRST_DOWNLOAD=SECONDS`` holds the node's first state download
that long once its donors described the state, before its first chunk, so a test can
make the swarm commit during a download (as it does while a big state crosses the
internet).

``GONKA_TEST_STEP_SECONDS=SECONDS`` makes every inner step wait that long before it
runs, as a host whose steps run on an accelerator waits on it with an idle CPU: a
test swarm's rounds then last as long as the test needs without keeping the machine's
cores busy (a tiny model's steps on a CPU are otherwise back to back, and a swarm of
three saturates two cores whatever the test waits for).

The variables are read once, at start-up (``from_environ``, called by
``node.config.load_injection``), into a ``Faults`` that is handed to the components
that act on it (``RoundProtocol``, ``ShardPlane`` and its ``PartExchange``,
``StateServer``); a component given none gets ``NO_FAULTS``, which never acts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import threading
from dataclasses import dataclass
from typing import Callable, Mapping

ENV = "GONKA_TEST_FAULT"
HOLD_ENV = "GONKA_TEST_HOLD_FIRST_DOWNLOAD"
STEP_ENV = "GONKA_TEST_STEP_SECONDS"
PHASES = ("grouped", "reduce", "gather", "commit", "serve")

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Faults:
    """Where this node dies, and how long it holds its first downloaded state; the default does neither."""

    phase: str = ""  # one of PHASES; "": never die
    round: int = 0  # ... at that phase of this round or a later one
    members: int = 0  # ... in a group of at least this many members
    hold_seconds: float = 0.0  # the first downloaded state waits this long (once)
    step_seconds: float = 0.0  # every inner step waits this long first
    stop: bool = False  # SIGSTOP at the phase instead of SIGKILL

    def __post_init__(self) -> None:
        assert self.phase in ("", *PHASES) and self.round >= 0 and self.members >= 0
        assert self.hold_seconds >= 0 and self.step_seconds >= 0

    @property
    def any(self) -> bool:
        return bool(self.phase) or self.hold_seconds > 0 or self.step_seconds > 0

    def paced(self, should_stop: Callable[[], bool], stop: threading.Event) -> Callable[[], bool]:
        """``should_stop`` (asked before every inner step), waiting ``step_seconds`` first, or
        until ``stop`` is set, when a test asked for paced steps."""
        if not self.step_seconds:
            return should_stop

        def paced() -> bool:
            stop.wait(self.step_seconds)
            return should_stop()

        return paced

    def checkpoint(self, phase: str, round: int, members: int = 0) -> None:
        """Die here if the test asked for a fault at this phase of this round."""
        if self.phase == phase and round >= self.round and members >= self.members:
            sig = signal.SIGSTOP if self.stop else signal.SIGKILL
            log.warning("fault injection: %s at %s of round %d", sig.name, phase, round)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), sig)

    async def hold_download(self) -> None:
        """Once the donors described a state, before its first chunk: wait if a test asked to
        hold the first download (the donors move on meanwhile, as from a joiner far away)."""
        if self.hold_seconds > 0:
            seconds, self.hold_seconds = self.hold_seconds, 0.0
            log.warning("fault injection: holding the first state download %.1fs", seconds)
            await asyncio.sleep(seconds)


NO_FAULTS = Faults()  # acts on nothing, so sharing it is safe


def _seconds(text: str, variable: str) -> float:
    try:
        seconds = float(text or 0.0)
    except ValueError:
        seconds = -1.0
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{variable}: expected a number of seconds (got {text!r})")
    return seconds


def parse(fault: str = "", hold: str = "", step: str = "") -> Faults:
    """``PHASE@ROUND[:MEMBERS]``, ``SECONDS`` and ``SECONDS`` as above ("": none); ValueError
    naming the variable."""
    phase, round, members, stop = "", 0, 0, False
    if fault:
        where, _, action = fault.partition("/")
        phase, _, rest = where.partition("@")
        round_text, _, members_text = rest.partition(":")
        if (phase not in PHASES or not round_text.isdigit() or not (members_text or "0").isdigit()
                or action not in ("", "stop")):
            raise ValueError(f"{ENV}: expected PHASE@ROUND[:MEMBERS][/stop] with PHASE in {', '.join(PHASES)} "
                             f"(got {fault!r})")
        round, members, stop = int(round_text), int(members_text or 0), action == "stop"
    return Faults(phase, round, members, _seconds(hold, HOLD_ENV), _seconds(step, STEP_ENV), stop)


def from_environ(environ: Mapping[str, str]) -> Faults:
    """The faults a test set in ``environ`` (``ENV``, ``HOLD_ENV``, ``STEP_ENV``)."""
    return parse(environ.get(ENV, ""), environ.get(HOLD_ENV, ""), environ.get(STEP_ENV, ""))
