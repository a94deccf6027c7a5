"""The built-in language model: a small GPT-style decoder over bytes.

Every peer builds the same model from the same seed, so the swarm starts from
one bit-identical set of parameters without downloading anything. Presets
cover CPU tests (tiny), a single GPU (small) and a real run (base).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.config import ModelConfig

# Byte-level tokenizer: a token is a byte value, so no vocabulary file is needed.
VOCAB_SIZE = 256

# Parameter counts (tied embeddings): tiny ~0.84M, small ~25.5M, base ~128M.
PRESETS: dict[str, dict] = {
    "tiny": {"n_layer": 4, "n_head": 4, "d_model": 128, "context": 128},
    "small": {"n_layer": 8, "n_head": 8, "d_model": 512, "context": 256},
    "base": {"n_layer": 18, "n_head": 12, "d_model": 768, "context": 512},
}


def context_length(preset: str) -> int:
    """Longest sequence the preset's position embedding covers."""
    if preset not in PRESETS:
        raise ValueError(f"model.preset: unknown preset {preset!r}")
    return PRESETS[preset]["context"]


def encode(text: str) -> list[int]:
    """Text to tokens: its UTF-8 bytes."""
    return list(text.encode("utf-8"))


def decode(tokens) -> str:
    """Tokens to text; a sampled model may emit invalid UTF-8, hence 'replace'."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        assert d_model % n_head == 0, "d_model must split evenly across heads"
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer with learned positions and tied input/output embeddings."""

    def __init__(
        self,
        *,
        n_layer: int,
        n_head: int,
        d_model: int,
        context: int,
        vocab_size: int = VOCAB_SIZE,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.n_layer = n_layer
        self.context = context
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        # Sharing the embedding with the output layer saves vocab*d parameters
        # and is what GPT-2 does.
        self.lm_head.weight = self.wte.weight

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, t = idx.shape
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the model's context {self.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """GPT-2 initialisation drawn from ``generator`` only (never the global RNG)."""
        # Residual projections are scaled down so the residual stream's variance
        # does not grow with depth (GPT-2, section 2.3).
        resid_std = 0.02 / math.sqrt(2 * self.n_layer)
        for name, module in self.named_modules():
            if module is self.lm_head:
                continue  # tied to wte, initialised there
            if isinstance(module, nn.Linear):
                std = resid_std if name.endswith(".proj") else 0.02
                module.weight.normal_(0.0, std, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 0.02, generator=generator)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    """The preset's model on CPU, initialised deterministically from ``seed``."""
    spec = PRESETS[cfg.preset]
    # Build on the meta device and fill every tensor ourselves: no time spent on
    # torch's default init and no draw from the process-wide RNG.
    with torch.device("meta"):
        model = GPT(**spec, dropout=cfg.dropout)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    model.init_weights(generator)
    return model
