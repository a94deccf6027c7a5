"""The DiLoCo outer optimizer: SGD with (Nesterov) momentum on the global parameters.

It is torch.optim.SGD itself, fed the averaged pseudo-gradient as the
gradient, so its arithmetic is torch's to the bit; every peer applying the
same averaged delta to the same parameters and momentum ends bit-identical.
It acts on a plain list of tensors, whatever part of a model they are.
"""

from __future__ import annotations

import torch

from trainer.config import OuterConfig


class OuterOptimizer:
    """Outer step on global fp32 tensors, updated in place."""

    def __init__(self, params: list[torch.Tensor], cfg: OuterConfig) -> None:
        self.params = list(params)
        self.cfg = cfg
        self.steps = 0
        self._sgd = torch.optim.SGD(self.params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)

    def _check(self, tensors: list[torch.Tensor], what: str) -> None:
        if len(tensors) != len(self.params):
            raise ValueError(f"{what}: {len(tensors)} tensors, expected {len(self.params)}")
        for i, (t, p) in enumerate(zip(tensors, self.params)):
            if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != p.dtype:
                raise ValueError(f"{what}: tensor {i} does not match parameter {tuple(p.shape)} {p.dtype}")

    @torch.no_grad()
    def step(self, avg_delta: list[torch.Tensor]) -> None:
        """m <- mu m + delta; theta <- theta - lr (delta + mu m) (Nesterov) or theta - lr m."""
        self._check(avg_delta, "outer step")
        for p, d in zip(self.params, avg_delta):
            p.grad = d.to(p.device)
        try:
            self._sgd.step()
        finally:
            for p in self.params:
                p.grad = None
        self.steps += 1

    def momentum_buffers(self) -> list[torch.Tensor]:
        """The momentum m, zeros before the first step (and when momentum is 0)."""
        out = []
        for p in self.params:
            buf = self._sgd.state.get(p, {}).get("momentum_buffer")
            out.append(torch.zeros_like(p) if buf is None else buf)
        return out

    def state_dict(self) -> dict:
        return {"steps": self.steps, "momentum": [b.detach().clone() for b in self.momentum_buffers()]}

    def load_state_dict(self, d: dict) -> None:
        if not isinstance(d, dict) or not isinstance(d.get("steps"), int) or d["steps"] < 0:
            raise ValueError("outer optimizer state: missing or invalid steps")
        momentum = d.get("momentum")
        if not isinstance(momentum, list):
            raise ValueError("outer optimizer state: missing momentum")
        self._check(momentum, "outer optimizer state")
        self._sgd.state.clear()
        # Before the first step torch has no buffer and sets m = delta exactly;
        # installing zeros instead would be equal in value but not always in
        # bits (0 + -0.0 = +0.0), so a fresh state stays buffer-less.
        if d["steps"] > 0 and self.cfg.momentum > 0:
            for p, m in zip(self.params, momentum):
                self._sgd.state[p]["momentum_buffer"] = m.detach().clone().to(p.device)
        self.steps = d["steps"]
