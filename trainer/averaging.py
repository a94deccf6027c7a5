"""The averaging interface, the only door from the outer algorithm to the network.

The swarm implements ``Averager`` over libp2p; ``InProcessGroup`` implements it
for k workers inside one process (the simulator and the tests), so the same
DiLoCo code runs in both and in-process convergence can be trusted for the swarm.
The group combines the members' tensors with ``combine``: the exact mean by
default, or the swarm's own aggregation (``p2p.compression.SwarmAverage``).
``HostileMember`` sends an attacker's pseudo-gradient instead of its worker's.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

import torch


class Averager(Protocol):
    async def average(self, tensors: list[torch.Tensor], weight: float, round: int) -> list[torch.Tensor] | None:
        """Σ w_i t_i / Σ w_i over the round's members, identical for every member;
        None when the round aborted for this caller (it then applies nothing)."""
        ...


def weighted_average(contributions: list[tuple[list[torch.Tensor], float]]) -> list[torch.Tensor]:
    """Σ w_i t_i / Σ w_i, summed in the given order, in float64 then cast back.

    float64 keeps the result exact for a single member (w t / w == t) and makes
    the sum's rounding negligible next to the fp32 result.
    """
    total = sum(w for _, w in contributions)
    first = contributions[0][0]
    out = []
    for i, ref in enumerate(first):
        acc = torch.zeros(ref.shape, dtype=torch.float64)
        for tensors, w in contributions:
            acc += tensors[i].detach().to("cpu", torch.float64) * w
        out.append((acc / total).to(ref.dtype))
    return out


# The members' (tensors, weight) in member order -> the round's result.
Combine = Callable[[list[tuple[list[torch.Tensor], float]]], list[torch.Tensor]]


def _fill(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    # Against the honest direction: -value where the honest value is >= 0, +value elsewhere.
    return lambda t: torch.where(t < 0, value, -value).to(t.dtype)


def attack(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a hostile member sends in place of one of its honest tensors t: ``fill:V`` (every value
    ±V, against the sign of t's), ``scale:F`` (F · t); ValueError otherwise."""
    name, _, arg = kind.partition(":")
    try:
        value = float(arg)
    except ValueError:
        value = float("nan")
    if name not in ("fill", "scale") or value != value or abs(value) == float("inf"):
        raise ValueError(f"attack kind must be fill:V or scale:F with a finite number (got {kind!r})")
    return _fill(value) if name == "fill" else (lambda t: t * value)


class HostileMember:
    """An ``Averager`` whose member sends ``attack(kind)`` of its pseudo-gradient, with its honest
    weight (the swarm caps weights), and applies the round's result like everyone else."""

    def __init__(self, inner: Averager, kind: str) -> None:
        self.inner = inner
        self.kind = kind
        self._attack = attack(kind)

    async def average(self, tensors: list[torch.Tensor], weight: float, round: int) -> list[torch.Tensor] | None:
        return await self.inner.average([self._attack(t.detach()) for t in tensors], weight, round)


class _Round:
    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.contributions: dict[int, tuple[list[torch.Tensor], float]] = {}
        self.result: asyncio.Future = asyncio.get_running_loop().create_future()


class InProcessGroup:
    """k in-process members; a round's average is computed once all contributions arrived.

    ``fail`` holds (worker_index, round) pairs: that member's call returns None and
    the others average without it, as when a peer drops out of a swarm round.
    ``combine`` turns the contributions, in member order, into the result.
    """

    def __init__(self, k: int, *, fail: set[tuple[int, int]] | frozenset = frozenset(),
                 combine: Combine = weighted_average) -> None:
        if k < 1:
            raise ValueError(f"group size must be >= 1 (got {k})")
        self.k = k
        self.fail = frozenset(fail)
        self.combine = combine
        self._rounds: dict[int, _Round] = {}
        self._done: set[int] = set()
        self._sat_out: set[tuple[int, int]] = set()

    def member(self, index: int) -> Averager:
        if not 0 <= index < self.k:
            raise ValueError(f"member index must be in [0, {self.k}) (got {index})")
        return _Member(self, index)

    def _expected(self, round: int) -> int:
        return sum(1 for i in range(self.k) if (i, round) not in self.fail and (i, round) not in self._sat_out)

    async def sit_out(self, index: int, round: int) -> list[torch.Tensor] | None:
        """Member ``index`` will not contribute to ``round`` but receives its average (a
        peer that re-synced while the round was already in flight)."""
        if round in self._done:
            return None
        self._sat_out.add((index, round))
        state = self._rounds.get(round)
        if state is None:
            state = self._rounds[round] = _Round(self._expected(round))
        else:
            state.expected -= 1
            self._maybe_finish(round, state)
        result = await state.result
        return None if result is None else [t.clone() for t in result]

    def _maybe_finish(self, round: int, state: "_Round") -> None:
        if len(state.contributions) == state.expected and not state.result.done():
            ordered = [state.contributions[i] for i in sorted(state.contributions)]
            # A round where nobody did any work has nothing to average.
            result = self.combine(ordered) if sum(w for _, w in ordered) > 0 else None
            state.result.set_result(result)
            del self._rounds[round]
            self._done.add(round)

    async def _average(self, index: int, tensors: list[torch.Tensor], weight: float, round: int) -> list[torch.Tensor] | None:
        if (index, round) in self.fail or round in self._done:
            # Injected failure, or a member that arrives after its round committed
            # (it was not part of it): either way, nothing to apply.
            await asyncio.sleep(0)
            return None
        state = self._rounds.get(round)
        if state is None:
            state = self._rounds[round] = _Round(self._expected(round))
        if index in state.contributions:
            raise RuntimeError(f"member {index} contributed twice to round {round}")
        if state.contributions:
            ref = next(iter(state.contributions.values()))[0]
            if len(ref) != len(tensors) or any(a.shape != b.shape for a, b in zip(ref, tensors)):
                raise ValueError(f"member {index} sent tensors that do not match the round's shapes")
        state.contributions[index] = ([t.detach().clone() for t in tensors], float(weight))
        self._maybe_finish(round, state)
        result = await state.result
        return None if result is None else [t.clone() for t in result]


class _Member:
    def __init__(self, group: InProcessGroup, index: int) -> None:
        self.group = group
        self.index = index

    async def average(self, tensors: list[torch.Tensor], weight: float, round: int) -> list[torch.Tensor] | None:
        return await self.group._average(self.index, tensors, weight, round)
