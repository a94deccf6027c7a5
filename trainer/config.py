"""Configuration of the trainer's components: model, data, inner loop, outer step.

Each component owns one small dataclass. Every field is documented where it is
defined and validated in ``__post_init__``: a bad value raises ``ValueError``
whose message starts with the field's dotted key (``inner.steps: ...``), which
the CLI turns into one line on stderr and exit code 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODEL_PRESETS = ("tiny", "small", "base")
MODEL_INITS = ("auto", "pretrained", "random")
PRECISIONS = ("auto", "bf16", "fp32")
VERIFY_MODES = ("start", "background", "off")
PARAM_DTYPES = ("fp32", "bf16")
OPTIMIZER_STATES = ("auto", "fp32", "bf16", "8bit")
OFFLOAD_MODES = ("none", "optimizer", "all")
OVERLAP_MODES = ("off", "delayed", "eager")


def require(ok: bool, key: str, message: str) -> None:
    """Raise the ValueError the CLI reports as ``key: message``."""
    if not ok:
        raise ValueError(f"{key}: {message}")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    # Where the model comes from: a built-in preset (tiny ~0.8M params for CPU tests
    # and the demo, small ~25M, base ~128M: small Llama configs over a byte vocabulary),
    # or hf:PATH, a local Hugging Face directory whose config.json names any causal-LM
    # architecture transformers knows. Never fetched from a hub.
    source: str = "tiny"
    # Initial parameters: pretrained (the safetensors weights in PATH, hf: only),
    # random (from the config, drawn from node.seed, bit-identical on every peer),
    # or auto (pretrained for hf:PATH, random for presets).
    init: str = "auto"
    # Recompute each decoder layer's activations in the backward pass instead of
    # keeping them: less accelerator memory for about a third more compute.
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        require(isinstance(self.source, str) and (self.source in MODEL_PRESETS or
                (self.source.startswith("hf:") and len(self.source) > 3)), "model.source",
                f"must be a preset ({', '.join(MODEL_PRESETS)}) or hf:PATH to a local model directory (got {self.source!r})")
        require(self.init in MODEL_INITS, "model.init", f"must be one of {', '.join(MODEL_INITS)} (got {self.init!r})")
        require(not (self.init == "pretrained" and self.source in MODEL_PRESETS), "model.init",
                f"pretrained needs hf:PATH; the preset {self.source!r} has no weights (use random or auto)")

    @property
    def hf_path(self) -> str | None:
        """The local model directory of an hf: source, else None."""
        return self.source[3:] if self.source.startswith("hf:") else None


@dataclass(kw_only=True, slots=True)
class DataConfig:
    # Training data: one directory written by `gonka-node prepare-data` (token shards and
    # their manifest.json; the way to train an hf: model), or text files and directories
    # of text files read as bytes (the byte-level presets; at most the first 64 MiB).
    # Empty: the built-in byte corpus, the Python standard library's sources on this machine.
    paths: list[str] = field(default_factory=list)
    # Token shards: check every shard's sha256 against the manifest at start (exit 2 on a
    # mismatch; about a second per 1.5 GB), in the background while training (a mismatch
    # stops the node, exit 1; for datasets too big to hash before every start), or off
    # (headers and sizes only, which are always checked).
    verify: str = "start"
    # Sequences per inner step on this peer (its tokens per step = batch_size * seq_len).
    batch_size: int = 8
    # Tokens per training sequence; 0 = the model's context length (max_position_embeddings).
    seq_len: int = 0
    # Fraction of the corpus held out for evaluation, the same on every peer.
    eval_fraction: float = 0.02
    # Batches of held-out data averaged for one eval loss figure.
    eval_batches: int = 8
    # Evaluate the global parameters every this many committed rounds; 0 = never.
    eval_every: int = 1

    def __post_init__(self) -> None:
        require(all(isinstance(p, str) and p for p in self.paths), "data.paths", "must be a list of non-empty paths")
        require(self.verify in VERIFY_MODES, "data.verify", f"must be one of {', '.join(VERIFY_MODES)} (got {self.verify!r})")
        require(self.batch_size >= 1, "data.batch_size", f"must be >= 1 (got {self.batch_size})")
        require(self.seq_len >= 0, "data.seq_len", f"must be >= 0 (got {self.seq_len})")
        require(0.0 < self.eval_fraction < 0.5, "data.eval_fraction", f"must be in (0, 0.5) (got {self.eval_fraction})")
        require(self.eval_batches >= 1, "data.eval_batches", f"must be >= 1 (got {self.eval_batches})")
        require(self.eval_every >= 0, "data.eval_every", f"must be >= 0 (got {self.eval_every})")


@dataclass(kw_only=True, slots=True)
class InnerConfig:
    # H: local AdamW steps between two outer synchronisations (when neither rule below is set).
    steps: int = 50
    # Heterogeneous hosts: end every round after this many seconds of inner steps on each
    # peer, whatever its speed; 0 = off. Each peer contributes the steps it managed,
    # weighted by its tokens. With round_tokens, whichever comes first ends the round.
    round_seconds: float = 0.0
    # Heterogeneous hosts: end every round once the round's peers together trained on this
    # many tokens (progress is shared through the heartbeats); 0 = off.
    round_tokens: int = 0
    # Peak learning rate of the inner AdamW.
    lr: float = 1e-3
    # Linear warmup, in inner steps counted over the whole run.
    warmup_steps: int = 50
    # Cosine decay horizon in inner steps (down to min_lr_ratio * lr); 0 = constant after warmup.
    total_steps: int = 0
    # Floor of the cosine schedule, as a fraction of lr.
    min_lr_ratio: float = 0.1
    # AdamW decoupled weight decay.
    weight_decay: float = 0.1
    # AdamW betas.
    beta1: float = 0.9
    beta2: float = 0.95
    # Global gradient-norm clip; 0 disables clipping.
    grad_clip: float = 1.0
    # Arithmetic of the inner steps: bf16 (autocast; the parameters and AdamW state stay
    # fp32), fp32 (TF32 matmuls on CUDA), or auto (bf16 on CUDA, fp32 on CPU).
    precision: str = "auto"
    # Memory modes (docs/memory.md: the bytes per parameter of each; `gonka-node plan` says
    # which fit). The swarm's θ and outer momentum stay fp32 whatever these are.
    # The local copy's parameters and gradients: fp32, or bf16 whose AdamW updates are
    # rounded stochastically (torchao), so updates smaller than a bf16 step are not lost.
    param_dtype: str = "fp32"
    # AdamW's moments: auto (the parameters' dtype), fp32 or bf16 (as the parameters must
    # be), or 8bit (block-wise quantized, torchao: 2 bytes a parameter for both moments).
    optimizer_state: str = "auto"
    # none; optimizer = AdamW's state in host RAM and its step on the CPU (torchao's
    # CPUOffloadOptimizer: one CUDA device, host.nproc_per_node = 1); all = parameters,
    # gradients and optimizer state in host RAM (FSDP2's CPUOffloadPolicy: FSDP2 ranks).
    offload: str = "none"
    # Tokens per chunk of the loss: the output layer and cross-entropy run chunk by chunk,
    # recomputed in the backward pass, so the logits of a whole batch (tokens x vocabulary,
    # fp32) never exist at once; 0 = the whole batch's logits at once.
    loss_chunk: int = 0
    # torch.compile each decoder block (the first steps compile: seconds to minutes).
    compile: bool = False

    def __post_init__(self) -> None:
        require(self.steps >= 1, "inner.steps", f"must be >= 1 (got {self.steps})")
        require(self.round_seconds >= 0, "inner.round_seconds", f"must be >= 0 (got {self.round_seconds})")
        require(self.round_tokens >= 0, "inner.round_tokens", f"must be >= 0 (got {self.round_tokens})")
        require(self.lr > 0, "inner.lr", f"must be > 0 (got {self.lr})")
        require(self.warmup_steps >= 0, "inner.warmup_steps", f"must be >= 0 (got {self.warmup_steps})")
        require(self.total_steps >= 0, "inner.total_steps", f"must be >= 0 (got {self.total_steps})")
        require(0.0 <= self.min_lr_ratio <= 1.0, "inner.min_lr_ratio", f"must be in [0, 1] (got {self.min_lr_ratio})")
        require(self.weight_decay >= 0, "inner.weight_decay", f"must be >= 0 (got {self.weight_decay})")
        require(0.0 <= self.beta1 < 1.0, "inner.beta1", f"must be in [0, 1) (got {self.beta1})")
        require(0.0 <= self.beta2 < 1.0, "inner.beta2", f"must be in [0, 1) (got {self.beta2})")
        require(self.grad_clip >= 0, "inner.grad_clip", f"must be >= 0 (got {self.grad_clip})")
        require(self.precision in PRECISIONS, "inner.precision", f"must be one of {', '.join(PRECISIONS)} (got {self.precision!r})")
        require(self.param_dtype in PARAM_DTYPES, "inner.param_dtype",
                f"must be one of {', '.join(PARAM_DTYPES)} (got {self.param_dtype!r})")
        require(self.optimizer_state in OPTIMIZER_STATES, "inner.optimizer_state",
                f"must be one of {', '.join(OPTIMIZER_STATES)} (got {self.optimizer_state!r})")
        require(self.offload in OFFLOAD_MODES, "inner.offload",
                f"must be one of {', '.join(OFFLOAD_MODES)} (got {self.offload!r})")
        require(self.loss_chunk >= 0, "inner.loss_chunk", f"must be >= 0 (got {self.loss_chunk})")
        require(not (self.param_dtype == "bf16" and self.precision == "fp32"), "inner.precision",
                "fp32 arithmetic needs fp32 parameters (inner.param_dtype = bf16 computes in bf16)")
        require(self.optimizer_state in ("auto", "8bit", self.param_dtype), "inner.optimizer_state",
                f"{self.optimizer_state} moments need inner.param_dtype = {self.optimizer_state} "
                f"(moments are kept in the parameters' dtype, or in 8 bits)")
        require(not (self.offload == "optimizer" and (self.param_dtype, self.optimizer_state) not in
                     (("fp32", "auto"), ("fp32", "fp32"))), "inner.offload",
                "optimizer offload steps fp32 AdamW on the CPU: it needs fp32 parameters and moments")

    @property
    def state_kind(self) -> str:
        """What AdamW's moments are: fp32, bf16 or 8bit."""
        return self.param_dtype if self.optimizer_state == "auto" else self.optimizer_state


@dataclass(kw_only=True, slots=True)
class OuterConfig:
    # Outer SGD learning rate applied to the averaged pseudo-gradient.
    lr: float = 0.7
    # Outer momentum; 0 = plain SGD (with swarm.error_feedback_decay < 1 and a sparse codec,
    # SparseLoCo's outer step). 0.7 / 0.6 were the best of a sweep at H = 30 and 50
    # (docs/benchmarks.md#sweep; DiLoCo's 0.7 / 0.9 ended 6-12% higher).
    momentum: float = 0.6
    # Nesterov momentum (DiLoCo's choice); false = heavy-ball.
    nesterov: bool = True
    # Overlap of the round's all-reduce with the next round's inner steps:
    # off = wait for the average, then train from the new global parameters;
    # delayed = train on from the last committed parameters while the average travels;
    # eager = as delayed, but start from a preview of the next outer step that uses this
    # peer's own pseudo-gradient in place of the unknown average
    # (Kale et al., arXiv 2502.12996). The global parameters stay bit-identical on all
    # peers in every mode: the preview is local, the outer step uses the committed average.
    overlap: str = "off"
    # With overlap: the inner step of the next round (1 = its first) at which the local copy
    # takes the round's committed average, waiting there for it if it has not landed yet;
    # 0 = at the first step after it lands, never waiting. When an average lands depends on
    # the network, so only a fixed step makes an overlapped run reproducible step for step
    # (1 is a round without overlap; a step past the round's end means its end).
    land_step: int = 0
    # Keep θ and the outer momentum (8 bytes a parameter) in memory-mapped files in this
    # directory on local disk (NVMe) instead of host RAM (trainer/hoststate.py); "" = in RAM.
    # Scratch files, rewritten at every start: checkpoints stay where they are.
    state_dir: str = ""

    def __post_init__(self) -> None:
        require(self.lr > 0, "outer.lr", f"must be > 0 (got {self.lr})")
        require(self.land_step >= 0, "outer.land_step", f"must be >= 0 (got {self.land_step})")
        require(0.0 <= self.momentum < 1.0, "outer.momentum", f"must be in [0, 1) (got {self.momentum})")
        require(self.overlap in OVERLAP_MODES, "outer.overlap", f"must be one of {', '.join(OVERLAP_MODES)} (got {self.overlap!r})")


PARALLEL_MODES = ("fsdp", "ddp")


@dataclass(kw_only=True, slots=True)
class HostConfig:
    # Local ranks this host trains on (torch.distributed.run; one per GPU, or CPU processes
    # over gloo). 1 = the node trains in its own process. Every host of a run uses the same
    # layout (the run's fingerprint covers it): rank k of every host syncs the same shard.
    nproc_per_node: int = 1
    # How the ranks share the model: fsdp = FSDP2 fully_shard (each rank holds 1/N of the
    # parameters, the inner optimizer state and the outer state); ddp = DDP, every rank a whole
    # replica (models that fit one device), each rank still syncing only 1/N of the parameters.
    parallel: str = "fsdp"

    def __post_init__(self) -> None:
        require(1 <= self.nproc_per_node <= 1024, "host.nproc_per_node",
                f"must be between 1 and 1024 (got {self.nproc_per_node})")
        require(self.parallel in PARALLEL_MODES, "host.parallel",
                f"must be one of {', '.join(PARALLEL_MODES)} (got {self.parallel!r})")
