"""The built-in presets' Llama as plain torch modules, without importing transformers.

A preset is a Llama (transformers' ``LlamaForCausalLM``, sdpa attention) over a
byte vocabulary. Importing transformers' modelling code costs ~2.7 s of CPU
(``transformers.modeling_utils`` pulls in torch.distributed.tensor,
torch._dynamo and scipy.optimize), more than the rest of a node's start-up
together, and every node of the demo and of the tests runs a preset. So the
presets are built here, with transformers' module tree and parameter names
(``model.embed_tokens.weight``, ``model.layers.0.self_attn.q_proj.weight``, ...,
``lm_head`` tied to the embeddings), its init scheme in its order, and its
forward's operations in its order: the same parameter bits from the same seed
and the same logits bit for bit (``tests/unit/test_presets.py`` builds both and
compares). Export writes the preset's config as a Llama config.json, which
transformers loads as its own ``LlamaForCausalLM``.

Only what the trainer uses is here: a causal forward over full windows (no
cache, no padding mask, no generation). ``hf:PATH`` models are transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Byte-level presets: a token is a byte value.
BYTE_VOCAB = 256

# Parameter counts (tied embeddings): tiny ~0.82M, small ~25M, base ~128M.
PRESETS: dict[str, dict] = {
    "tiny": {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4, "num_attention_heads": 4,
             "max_position_embeddings": 128},
    "small": {"hidden_size": 512, "intermediate_size": 1368, "num_hidden_layers": 8, "num_attention_heads": 8,
              "max_position_embeddings": 256},
    "base": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 12,
             "max_position_embeddings": 512},
}
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5
INITIALIZER_RANGE = 0.02


def preset_fields(name: str) -> dict:
    """The preset as a Llama config dict: what checkpoints carry, the fingerprint hashes and
    export writes as config.json (transformers fills the fields left out with its defaults)."""
    p = PRESETS[name]
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": BYTE_VOCAB, **p,
            "num_key_value_heads": p["num_attention_heads"], "head_dim": p["hidden_size"] // p["num_attention_heads"],
            "hidden_act": "silu", "rms_norm_eps": RMS_NORM_EPS, "initializer_range": INITIALIZER_RANGE,
            "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"}, "tie_word_embeddings": True,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


@dataclass(slots=True)
class CausalLMOutput:
    logits: torch.Tensor


class LlamaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(dtype)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.compute_buffers()

    def compute_buffers(self) -> None:
        """The frequencies, computed (on the default device): never drawn, never loaded."""
        inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=self.scaling,
                                             is_causal=q.shape[2] > 1)
        out = out.transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(*x.shape[:-1], -1))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hidden, heads)
        self.mlp = LlamaMLP(hidden, intermediate)
        self.input_layernorm = LlamaRMSNorm(hidden, RMS_NORM_EPS)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, RMS_NORM_EPS)
        self.checkpointed = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.checkpointed and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, fields: dict) -> None:
        super().__init__()
        hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
        self.embed_tokens = nn.Embedding(fields["vocab_size"], hidden)
        self.layers = nn.ModuleList(LlamaDecoderLayer(hidden, fields["intermediate_size"], heads)
                                    for _ in range(fields["num_hidden_layers"]))
        self.norm = LlamaRMSNorm(hidden, RMS_NORM_EPS)
        self.rotary_emb = LlamaRotaryEmbedding(hidden // heads)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        cos, sin = self.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class PresetLlama(nn.Module):
    """A built-in preset: ``LlamaForCausalLM``'s tree, names and bits, for the calls the trainer
    makes (``module(input_ids=x, use_cache=False).logits``, per-block FSDP units, activation
    checkpointing)."""

    _no_split_modules = ["LlamaDecoderLayer"]  # FSDP units, as transformers' model names them
    supports_gradient_checkpointing = True

    def __init__(self, name: str) -> None:
        """Parameters are allocated, not initialised (``initialize_weights`` draws them): built on
        the meta device, so torch's default init never runs (nor moves the global RNG)."""
        super().__init__()
        self.fields = preset_fields(name)
        with torch.device("meta"):
            self.model = LlamaModel(self.fields)
            self.lm_head = nn.Linear(self.fields["hidden_size"], BYTE_VOCAB, bias=False)
        self.tie_weights()

    def allocate(self) -> "PresetLlama":
        """Real (uninitialised) CPU memory for the parameters, and the computed buffers."""
        self.to_empty(device="cpu")
        self.tie_weights()
        self.model.rotary_emb.compute_buffers()
        return self

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each decoder layer in the backward pass (non-reentrant, as the trainer asks)."""
        if (gradient_checkpointing_kwargs or {}).get("use_reentrant", False):
            raise ValueError("presets checkpoint activations non-reentrant only")
        for layer in self.model.layers:
            layer.checkpointed = True

    @property
    def is_activation_checkpointing(self) -> bool:
        return any(layer.checkpointed for layer in self.model.layers)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> CausalLMOutput:
        return CausalLMOutput(logits=self.lm_head(self.model(input_ids)))

    def initialize_weights(self, normal_) -> None:
        """transformers' scheme in its order (children before parents, so every Linear and the
        embedding in module order): N(0, initializer_range) drawn by ``normal_(tensor, mean, std)``,
        norms 1. The tied ``lm_head`` comes last; its draw is dropped, as the tie keeps the
        embedding's."""
        with torch.no_grad():
            for module in self.modules():
                if module is self.lm_head:
                    continue
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    normal_(module.weight, 0.0, INITIALIZER_RANGE)
                elif isinstance(module, LlamaRMSNorm):
                    module.weight.fill_(1.0)
