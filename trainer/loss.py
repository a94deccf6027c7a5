"""A loss that never holds a whole batch's logits (``[inner] loss_chunk``).

A causal LM's last layer turns each position's hidden state into one logit per vocabulary entry:
at 8 sequences of 8192 tokens and a 152k vocabulary, fp32 logits (which the cross-entropy is
taken in) are 40 GB, and their gradient as much again: more than the rest of a rank's
activations. With a chunk of C tokens, the output layer and the cross-entropy run C tokens at a
time inside ``torch.utils.checkpoint``: the forward keeps only each chunk's summed loss, and the
backward recomputes one chunk's logits at a time (C x vocabulary fp32: 1.2 GB at C = 2048 and
152k) — one more pass of the output layer's matmul (for a 70B Llama, 1 of 70B parameters: ~1.5%
more FLOPs).

The maintained fused kernels (Liger's fused linear cross-entropy, Apple's cut cross-entropy) are
Triton, CUDA only; this torch form runs on every device the node does, and under
``torch.compile``.

The chunked loss runs inside the model's own forward: the output layer is replaced by a
``ChunkedLossHead`` that holds the same parameters (tied ones stay tied) and returns the loss in
place of the logits. FSDP2's root unit (which holds the output layer) and DDP see one forward and
one backward as before: their hooks gather, reduce and free exactly as they would.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Architectures whose forward returns ``lm_head(hidden)`` as the logits, with nothing applied
# after it (no soft-capping or scaling): the chunked head gives them exactly their loss.
PLAIN_HEAD_TYPES = ("preset", "llama", "qwen2", "qwen3", "mistral")


class ChunkedLossHead(nn.Linear):
    """The output layer of a causal LM that returns the mean cross-entropy against ``targets``
    (set for one forward by ``lm_loss``) instead of the logits. A Linear still, to every code that
    initialises, ties or names the model's layers."""

    def __init__(self, linear: nn.Linear, chunk: int) -> None:
        nn.Module.__init__(self)  # no new parameters: the Linear's own (ties and names stay)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.chunk = chunk
        self.targets: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            raise RuntimeError("ChunkedLossHead: forward without targets (call trainer.model.lm_loss)")
        return chunked_cross_entropy(hidden, self.weight, self.bias, self.targets, self.chunk)


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T + bias`` against ``targets``, ``chunk`` tokens at a
    time, each chunk's logits recomputed in the backward pass rather than kept."""
    h = hidden.reshape(-1, hidden.size(-1))
    t = targets.reshape(-1).to(h.device)
    if t.numel() != h.size(0):
        raise ValueError(f"chunked loss: {h.size(0)} positions, {t.numel()} targets")
    total = None
    for start in range(0, h.size(0), chunk):
        part = checkpoint(_chunk_loss, h[start:start + chunk], weight, bias, t[start:start + chunk],
                          use_reentrant=False)
        total = part if total is None else total + part
    return total / t.numel()


def model_type(module: nn.Module) -> str:
    """The architecture's name as its config gives it (``preset`` for the built-in presets)."""
    config = getattr(module, "config", None)
    return getattr(config, "model_type", None) or ("preset" if hasattr(module, "fields") else type(module).__name__)


def install_chunked_loss(module: nn.Module, chunk: int) -> nn.Module:
    """Replace ``module.lm_head`` by a ``ChunkedLossHead`` (before the model is sharded or wrapped:
    FSDP2 keeps references to the modules it manages). ValueError naming ``inner.loss_chunk``
    for an architecture whose logits are more than its output layer's."""
    kind = model_type(module)
    head = getattr(module, "lm_head", None)
    if kind not in PLAIN_HEAD_TYPES or not isinstance(head, nn.Linear):
        raise ValueError(f"inner.loss_chunk: the chunked loss is for {', '.join(PLAIN_HEAD_TYPES)} models "
                         f"(an output layer whose result is the logits); {kind} is not one (use 0)")
    module.lm_head = ChunkedLossHead(head, chunk)
    return module


def loss_head(module: nn.Module) -> ChunkedLossHead | None:
    """The chunked head of ``module`` (or of the model a DDP wrapper holds), if it has one."""
    inner = getattr(module, "module", module)  # DDP
    head = getattr(inner, "lm_head", None)
    return head if isinstance(head, ChunkedLossHead) else None
