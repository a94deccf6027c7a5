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
- ``flood``: open streams to every peer and leave them open;
- ``sparse=pile|duplicate|max`` (a sparse codec's freedom): every index of a chunk on one
  coordinate, a repeated index, or the largest values the format allows (legal bytes);
- contributions that are not work (p2p/ledger.py's verdicts): ``free_ride`` (zeros, with an
  honest token claim), ``noise`` (random values with the honest norm), ``replay`` (its
  previous round's pseudo-gradient again), ``copy_to=PATH`` / ``copy_from=PATH`` (two
  colluders: one leaves its pseudo-gradient of round r at PATH.r, the other sends that
  instead of its own), ``overclaim`` (one inner step a round, the tokens of H claimed),
  ``shirk`` (trains on other data than assigned).

The hooks sit where an attacker would act, in the node's own code. The variable is
read once, at start-up (``from_environ``, called by ``node.config.load_injection``), into
a ``Behaviour`` handed to ``RoundProtocol`` (which gives it to its ``ShardPlane`` and
groups, and the training loop reads it there); a component given none is ``HONEST``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping

ENV = "GONKA_TEST_HOSTILE"
COPY_WAIT_SECONDS = 60.0
_FLAGS = ("abort", "silent_leader", "alter_slice", "fake_state", "fake_states", "flood", "free_ride", "noise",
          "replay", "overclaim", "shirk")
_VALUES = ("scale", "fill", "weight")
_PATHS = ("copy_to", "copy_from")
_CHOICES = {"sparse": ("pile", "duplicate", "max")}


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
    sparse: str | None = None
    free_ride: bool = False
    noise: bool = False
    replay: bool = False
    copy_to: str | None = None
    copy_from: str | None = None
    overclaim: bool = False
    shirk: bool = False

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
        elif name in _CHOICES and value in _CHOICES[name]:
            fields[name] = value
        elif name in _PATHS and value:
            fields[name] = value
        elif name in _VALUES and eq:
            try:
                fields[name] = float(value)
            except ValueError:
                raise ValueError(f"{ENV}: {name} needs a number (got {value!r})") from None
        else:
            choices = ", ".join(f"{key}={'|'.join(values)}" for key, values in _CHOICES.items())
            known = ", ".join(_FLAGS + _VALUES + tuple(f"{p}=PATH" for p in _PATHS))
            raise ValueError(f"{ENV}: unknown behaviour {item!r} (known: {known}, {choices})")
    return Behaviour(**fields)


HONEST = Behaviour()


def from_environ(environ: Mapping[str, str]) -> Behaviour:
    """The behaviour a test or the attack script set in ``environ`` (``ENV``)."""
    return parse(environ.get(ENV, ""))


# ---- what a lying node does (called where the node's own code would act honestly) ------------

def corrupt(flat, b: Behaviour, round: int = 0, memory: dict | None = None) -> None:
    """The pseudo-gradient a member that lies about it sends, in place (``round``: the state it
    comes from; ``memory``: what a replaying liar keeps between rounds). Tensor work; a colluder
    copying another's waits for its file (at most COPY_WAIT_SECONDS, then sends its own)."""
    import torch

    memory = {} if memory is None else memory
    if b.copy_to:  # leave ours for the colluder (honest values: its copy is the lie)
        path = f"{b.copy_to}.{round}"
        torch.save(flat.clone(), path + ".tmp")
        os.replace(path + ".tmp", path)
    if b.copy_from:
        path, deadline = f"{b.copy_from}.{round}", time.monotonic() + COPY_WAIT_SECONDS
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.path.exists(path):
            theirs = torch.load(path, weights_only=True)
            if theirs.shape == flat.shape:
                flat.copy_(theirs)
    if b.replay:
        previous = memory.get("replay")
        memory["replay"] = flat.clone()
        if previous is not None and previous.shape == flat.shape:
            flat.copy_(previous)
    if b.noise:
        norm = float(flat.norm())
        flat.normal_().mul_(norm / max(float(flat.norm()), 1e-30))
    if b.free_ride:
        flat.zero_()
    if b.scale is not None:
        flat.mul_(b.scale)
    if b.fill is not None:
        flat.fill_(b.fill)


def forge_sparse(codec, payload: bytes, numel: int, kind: str) -> bytes:
    """A sparse codec's payload rewritten as ``sparse=KIND`` sends it: ``pile`` (every index of
    a chunk 0), ``duplicate`` (each chunk's second index equal to its first) or ``max`` (lo and
    step at the format's limit, every value at the top level: legal, and as large as legal)."""
    import torch

    from p2p.sparsecodec import SCALE_LIMIT, _pack, _unpack

    chunks, count, index_bytes, _ = codec._layout(numel)
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    scales = raw[: 8 * chunks].view(torch.float32).clone()
    indices = _unpack(raw[8 * chunks : 8 * chunks + index_bytes], count, codec.index_bits)
    codes = _unpack(raw[8 * chunks + index_bytes :], count, codec.bits)
    per_chunk = [codec.kept(min(codec.chunk, numel - c * codec.chunk)) for c in range(chunks)]
    firsts = torch.tensor([0, *per_chunk[:-1]]).cumsum(0)
    if kind == "pile":
        indices.zero_()
    elif kind == "duplicate":
        seconds = firsts[torch.tensor(per_chunk) > 1]
        indices[seconds + 1] = indices[seconds]
    elif kind == "max":
        scales.fill_(SCALE_LIMIT)
        codes.fill_(codec.levels)
    return b"".join([scales.view(torch.uint8).numpy().tobytes(), _pack(indices, codec.index_bits).numpy().tobytes(),
                     _pack(codes, codec.bits).numpy().tobytes()])


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
