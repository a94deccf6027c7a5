"""Error feedback: what a lossy codec dropped from a vector, added back the next round.

A lossy codec (p2p/blockcodecs.py, fp16, bf16) leaves each round's contribution a
little off; keeping the difference and adding it to the next round's vector makes
the errors cancel over rounds instead of adding up. The round protocol keeps one
per node (``RoundProtocol.ensure_feedback``, p2p/rounds.py), saved in its checkpoint.
"""

from __future__ import annotations

import torch

from p2p.codec import Codec


class ErrorFeedback:
    """Keeps what a lossy codec dropped from one flat vector and adds it back next round.

    Per round: ``sent = compensate(x)``, transmit ``encode(sent)``, then
    ``update(sent, decode(encode(sent)))``; or all three at once with ``encode``.
    """

    def __init__(self, numel: int, scratch=None) -> None:
        """``scratch(numel)``: a new vector of zeros where the residual's copies live (memory-mapped
        with ``outer.state_dir``, trainer/hoststate.py); None: RAM."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        self.scratch = scratch
        self.residual = scratch(numel) if scratch is not None else torch.zeros(numel, dtype=torch.float32)
        # True while ``residual`` holds a round's compensated contribution (``fold``) rather than
        # a residual: from the fold until that round commits (``settle``).
        self.holding = False
        self.restarts = 0  # folds that found the last round's vector never settled (``fold``)

    def fold(self, x: torch.Tensor) -> None:
        """Add the residual into ``x`` (a round's own vector, consumed), which becomes the
        residual's storage: the round writes the next residual over it in place, and the old
        vector's memory is given back. ``holding`` until the round commits. ``x`` may be the
        residual's vector itself, the pseudo-gradient added into it already (``target``): then
        no second vector exists at all."""
        if x is self.residual:
            if self.holding:
                raise ValueError("this vector is a round's already: give the next round a vector of its own")
            self.holding = True  # the pseudo-gradient was added into it (``pseudo_gradient(into=)``)
            return
        if x.shape != self.residual.shape or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"error feedback holds {self.residual.numel()} fp32 values, got {x.dtype} {tuple(x.shape)}")
        if self.holding:
            # The round that took the last vector never committed (the swarm moved past it, or it
            # was given up): that vector holds a pseudo-gradient nobody will apply, not only what a
            # codec dropped. Nothing is added back; what earlier rounds dropped is lost with it.
            self.restarts += 1
        else:
            x.add_(self.residual)
        self.residual, self.holding = x, True

    @property
    def target(self) -> torch.Tensor | None:
        """The vector to add the next pseudo-gradient into (the residual's, once its round
        committed), so that it holds the compensated contribution without a vector of Δ
        alone; None while a round holds it."""
        return None if self.holding else self.residual

    def settle(self) -> None:
        """The round that holds the residual's vector committed: it holds the next residual."""
        self.holding = False

    def compensate(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus the residual left by earlier rounds (a new tensor)."""
        if x.shape != self.residual.shape:
            raise ValueError(f"error feedback holds {self.residual.numel()} values, got shape {tuple(x.shape)}")
        return x + self.residual

    def update(self, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        """Remember what the receivers did not get: ``compensated - transmitted``."""
        torch.sub(compensated, transmitted, out=self.residual)

    def adopt(self, residual: torch.Tensor) -> torch.Tensor:
        """Take ``residual`` (``compensated - transmitted``, computed elsewhere, e.g. piece by piece
        during a round) as the new residual; returns the old one, whose buffer the caller may reuse."""
        if residual.shape != self.residual.shape or residual.dtype != torch.float32:
            raise ValueError(f"error feedback holds {self.residual.numel()} fp32 values, got {residual.dtype} "
                             f"{tuple(residual.shape)}")
        old, self.residual = self.residual, residual
        return old

    def encode(self, codec: Codec, x: torch.Tensor) -> bytes:
        """Compensate ``x``, encode it, and keep the new residual; returns the payload."""
        compensated = self.compensate(x)
        transmitted = torch.empty_like(compensated)
        payload = codec.encode(compensated, transmitted)  # raises before the residual changes
        self.update(compensated, transmitted)
        return payload

    def reset(self) -> None:
        self.residual.zero_()

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """None while a round holds the vector (``holding``: a pseudo-gradient is in it, not only
        what a codec dropped): a checkpoint then keeps no residual, and feedback starts over."""
        if self.holding:
            return None
        return {"residual": self.residual.clone() if self.scratch is None else
                self.scratch(self.residual.numel()).copy_(self.residual)}

    def load_state_dict(self, state: dict) -> None:
        residual = state.get("residual") if isinstance(state, dict) else None
        if not isinstance(residual, torch.Tensor) or residual.dim() != 1 or not residual.is_floating_point():
            raise ValueError("error feedback state needs a 1-D float tensor 'residual'")
        if residual.numel() != self.residual.numel():
            raise ValueError(f"error feedback residual has {residual.numel()} values, expected {self.residual.numel()}")
        if not torch.isfinite(residual).all():
            raise ValueError("error feedback residual holds non-finite values")
        residual = residual.detach().to(device="cpu", dtype=torch.float32)
        self.residual = residual.clone() if self.scratch is None else self.scratch(residual.numel()).copy_(residual)
        self.holding = False
