"""Hostile behaviour for tests and ``scripts/attack.py``: a node that lies the way an attacker would.

Set ``GONKA_TEST_HOSTILE=KIND[,KIND...]`` in a node's environment (only tests
and the attack script do). Kinds:

- ``scale=F``: send F times its honest pseudo-gradient (F = -1000, 1e4, -10, ...);
- ``fill=V``: send a pseudo-gradient of the value V everywhere (1e30, 3.4e38, -3.4e38);
- ``weight=W``: claim W tokens of weight (1e30, -1, ...);
- ``abort``: join every group, then abort it;
- ``silent_leader``: announce ready, but never send ``begin`` when it leads;
- ``alter_slice``: as a part owner, return a finite but wrong average;
- ``fake_state``: announce a round 1000 ahead with a state of its own (zeros) and serve it;
- ``fake_states``: the same with another state (another hash) every round;
- ``flood``: open streams to every peer and leave them open.

The hooks sit where an attacker would act, in the node's own code. The variable is
read once, at start-up (``from_environ``, called by ``node.config.load_injection``), into
a ``Behaviour`` handed to ``RoundProtocol`` (which gives it to its ``ShardPlane`` and
groups, and the training loop reads it there); a component given none is ``HONEST``.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping

ENV = "GONKA_TEST_HOSTILE"
_FLAGS = ("abort", "silent_leader", "alter_slice", "fake_state", "fake_states", "flood")
_VALUES = ("scale", "fill", "weight")


@dataclass(frozen=True, slots=True)
class Behaviour:
    """How this node lies (the kinds above); ``Behaviour()`` (``HONEST``) does not."""

    scale: float | None = None
    fill: float | None = None
    weight: float | None = None
    abort: bool = False
    silent_leader: bool = False
    alter_slice: bool = False
    fake_state: bool = False
    fake_states: bool = False
    flood: bool = False

    @property
    def fakes_state(self) -> bool:
        """Claims a far newer round with a state of its own (``fake_state`` or ``fake_states``)."""
        return self.fake_state or self.fake_states

    @property
    def any(self) -> bool:
        return self != Behaviour()


def parse(spec: str) -> Behaviour:
    """``KIND[,KIND...]`` as above; ValueError naming the variable if malformed."""
    fields: dict = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, eq, value = item.partition("=")
        if name in _FLAGS and not eq:
            fields[name] = True
        elif name in _VALUES and eq:
            try:
                fields[name] = float(value)
            except ValueError:
                raise ValueError(f"{ENV}: {name} needs a number (got {value!r})") from None
        else:
            raise ValueError(f"{ENV}: unknown behaviour {item!r} (known: {', '.join(_FLAGS + _VALUES)})")
    return Behaviour(**fields)


HONEST = Behaviour()


def from_environ(environ: Mapping[str, str]) -> Behaviour:
    """The behaviour a test or the attack script set in ``environ`` (``ENV``)."""
    return parse(environ.get(ENV, ""))


# ---- what a lying node does (called where the node's own code would act honestly) ------------

def corrupt(flat, b: Behaviour) -> None:
    """The pseudo-gradient a member that lies about it sends (``scale``, ``fill``), in place. Tensor work."""
    if b.scale is not None:
        flat.mul_(b.scale)
    if b.fill is not None:
        flat.fill_(b.fill)


async def flood(peers: Callable[[], Awaitable[dict]], open_stream: Callable[[str, str], Awaitable]) -> None:
    """``flood``: open streams to every peer (``peers()``, read every second) and never write a
    byte on them, until cancelled."""
    held = []
    while True:
        for peer in list(await peers()):
            for _ in range(16):
                with contextlib.suppress(Exception):
                    held.append(await open_stream(peer, "part"))
        del held[:-4096]
        await asyncio.sleep(1.0)
