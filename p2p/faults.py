"""Fault injection for tests: a node SIGKILLs itself at a chosen point of a chosen round.

Set ``GONKA_TEST_FAULT=PHASE@ROUND[:MEMBERS]`` in a node's environment: the node
dies at the first PHASE of round ROUND or later (the round being averaged, i.e.
the committed round + 1) in a group of at least MEMBERS peers. Phases:

- ``grouped``: the group is agreed, before this member sent anything;
- ``reduce``: its slices are sent, before any averaged part came back;
- ``gather``: it holds some averaged parts, not all;
- ``commit``: every vote is in and agrees, before the outer step is applied;
- ``serve``: a peer asked it for a piece of the state, before it answered.

Only tests set it; a node without the variable never takes these branches.

``GONKA_TEST_HOLD_FIRST_DOWNLOAD=SECONDS`` holds the node's first downloaded state
that long before loading it, so a test can make the swarm commit meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

ENV = "GONKA_TEST_FAULT"
HOLD_ENV = "GONKA_TEST_HOLD_FIRST_DOWNLOAD"
PHASES = ("grouped", "reduce", "gather", "commit", "serve")

log = logging.getLogger(__name__)


def _armed() -> tuple[str, int, int] | None:
    spec = os.environ.get(ENV, "")
    if not spec:
        return None
    phase, _, rest = spec.partition("@")
    round_text, _, members_text = rest.partition(":")
    if phase not in PHASES or not round_text.isdigit() or not (members_text or "0").isdigit():
        raise ValueError(f"{ENV}: expected PHASE@ROUND[:MEMBERS] with PHASE in {', '.join(PHASES)} (got {spec!r})")
    return phase, int(round_text), int(members_text or 0)


ARMED = _armed()


def checkpoint(phase: str, round: int, members: int = 0) -> None:
    """Die here if the test asked for a fault at this phase of this round."""
    if ARMED is not None and ARMED[0] == phase and round >= ARMED[1] and members >= ARMED[2]:
        log.warning("fault injection: SIGKILL at %s of round %d", phase, round)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)


_hold = float(os.environ.get(HOLD_ENV) or 0.0)


async def hold_download() -> None:
    """Before loading a downloaded state: wait if a test asked to hold the first one."""
    global _hold
    if _hold > 0:
        seconds, _hold = _hold, 0.0
        log.warning("fault injection: holding the first downloaded state %.1fs", seconds)
        await asyncio.sleep(seconds)
