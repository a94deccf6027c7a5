"""The DiLoCo outer optimizer: SGD with (Nesterov) momentum on the global parameters.

Its semantics are torch.optim.SGD's (the first step sets m = Δ; Nesterov
θ -= lr (Δ + μ m), heavy-ball θ -= lr m, no momentum θ -= lr Δ), but not its
kernels: torch's ``add_(x, alpha=a)`` fuses a*x + y into one rounding in its
vectorized CPU kernels and rounds twice in the scalar ones, so the same step
gave different bits under ATEN_CPU_CAPABILITY=default and avx2, and would on
an ARM host next to an x86 one. Here every product is its own op, rounded and
stored before it is added (``trainer.determinism``), so a peer's θ depends
only on its inputs, never on its CPU or on CPU versus GPU. The bits equal
torch's scalar (x86 ``default``) path. It acts on a plain list of tensors,
whatever part of a model they are.
"""

from __future__ import annotations

from typing import Sequence

import torch

from trainer.config import OuterConfig


class OuterOptimizer:
    """Outer step on global fp32 tensors, updated in place."""

    def __init__(self, params: list[torch.Tensor], cfg: OuterConfig, momentum=None) -> None:
        """``momentum``: where the momentum of each parameter lives once it exists (a list of
        tensors shaped like ``params``: memory-mapped, trainer/hoststate.py); None: new tensors."""
        self.params = list(params)
        self.cfg = cfg
        self.steps = 0
        self._storage = momentum
        # None until the first step with momentum: torch sets m = Δ exactly then, which
        # zeros would equal in value but not always in bits (0 + -0.0 = +0.0).
        self._momentum: list[torch.Tensor | None] = [None] * len(self.params)

    def _check(self, tensors: list[torch.Tensor], what: str) -> None:
        if len(tensors) != len(self.params):
            raise ValueError(f"{what}: {len(tensors)} tensors, expected {len(self.params)}")
        for i, t in enumerate(tensors):
            self._check_one(i, t, what)

    def _check_one(self, i: int, t: torch.Tensor, what: str) -> None:
        p = self.params[i]
        if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != p.dtype:
            raise ValueError(f"{what}: tensor {i} does not match parameter {tuple(p.shape)} {p.dtype}")

    @torch.no_grad()
    def _update(self, i: int, delta: torch.Tensor, in_place: bool) -> torch.Tensor:
        """θ_i after one step with Δ_i: into θ_i and m_i if ``in_place``, else into new tensors.

        One rounding per op. A Python scalar is first rounded to the tensor's dtype, as
        torch's SGD rounds lr and μ, so the bits are those of its unfused path."""
        cfg, theta, m = self.cfg, self.params[i], self._momentum[i]
        d = delta.detach().to(theta.device)
        if cfg.momentum == 0:
            step = torch.mul(d, cfg.lr)
        else:
            if m is None:
                m = self._new_momentum(i, d) if in_place else d
            else:
                m = m.mul_(cfg.momentum) if in_place else torch.mul(m, cfg.momentum)
                m.add_(d)
            if in_place:
                self._momentum[i] = m
            if cfg.nesterov:
                step = torch.mul(m, cfg.momentum).add_(d).mul_(cfg.lr)
            else:
                step = torch.mul(m, cfg.lr)
        return theta.sub_(step) if in_place else torch.sub(theta, step)

    def step(self, avg_delta: Sequence[torch.Tensor]) -> None:
        """m <- mu m + delta; theta <- theta - lr (delta + mu m) (Nesterov) or theta - lr m.

        ``avg_delta`` may compute each tensor as it is read (a round's ``CommittedAverage``):
        its ``views`` are checked first, and each tensor is read just before its update."""
        self._check(getattr(avg_delta, "views", avg_delta), "outer step")
        for i in range(len(avg_delta)):
            self._update(i, avg_delta[i], in_place=True)
        self.steps += 1

    def preview(self, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        """θ after one step with ``delta`` (new tensors), leaving θ and the momentum untouched."""
        self._check(delta, "outer preview")
        return [self._update(i, d, in_place=False) for i, d in enumerate(delta)]

    def preview_tensor(self, i: int, delta: torch.Tensor) -> torch.Tensor:
        """``preview``'s tensor ``i`` alone (a new tensor): for a Δ computed tensor by tensor."""
        self._check_one(i, delta, "outer preview")
        return self._update(i, delta, in_place=False)

    def _new_momentum(self, i: int, value: torch.Tensor) -> torch.Tensor:
        """Parameter i's momentum, a copy of ``value`` (bit for bit), in its storage if it has one."""
        if self._storage is None:
            return value.clone()
        return self._storage[i].copy_(value)

    def momentum_buffers(self) -> list[torch.Tensor]:
        """The momentum m, zeros before the first step (and when momentum is 0)."""
        return [torch.zeros_like(p) if m is None else m for p, m in zip(self.params, self._momentum)]

    def state_dict(self, copy=None) -> dict:
        """``copy(tensors)``: how the momentum is copied (default: into new tensors in RAM)."""
        buffers = self.momentum_buffers()
        return {"steps": self.steps,
                "momentum": copy(buffers) if copy is not None else [b.detach().clone() for b in buffers]}

    def load_state_dict(self, d: dict) -> None:
        if not isinstance(d, dict) or not isinstance(d.get("steps"), int) or d["steps"] < 0:
            raise ValueError("outer optimizer state: missing or invalid steps")
        momentum = d.get("momentum")
        if not isinstance(momentum, list):
            raise ValueError("outer optimizer state: missing momentum")
        self._check(momentum, "outer optimizer state")
        # A fresh state stays buffer-less (see __init__).
        if d["steps"] > 0 and self.cfg.momentum > 0:
            self._momentum = [self._new_momentum(i, m.detach().to(p.device)) for i, (p, m) in
                              enumerate(zip(self.params, momentum))]
        else:
            self._momentum = [None] * len(self.params)
        self.steps = d["steps"]
