"""What a run needs before it starts: memory per GPU and per host, bytes and time per round,
utilization, for each inner-loop memory mode (`gonka-node plan`, docs/memory.md).

The model is built on the meta device from its config (no weights, no memory), and every
per-rank figure comes from the node's own sharding: each parameter's dim-0 rows that FSDP2 gives
the largest rank (trainer/parallel.py ``rows_of``), the decoder blocks that are FSDP2's units
(``_blocks``), the codec's own wire size (p2p/codecs.py). What is not a parameter count is an
estimate, said so in each figure's name: activations (a Llama-style decoder's saved tensors per
token and layer, with and without per-block checkpointing), the loss's logits, FSDP2's gather
and reduce buffers, step time from FLOPs at an assumed model-FLOPs utilization.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

GiB = 2**30

# Per-device kinds `plan --gpu` knows: memory and dense bf16 peak (SXM parts).
GPUS = {
    "h100": dict(memory=80 * GiB, tflops=989.0),
    "h200": dict(memory=141 * GiB, tflops=989.0),
    "a100": dict(memory=80 * GiB, tflops=312.0),
}
# CUDA context, NCCL's buffers and the caching allocator's slack, per GPU.
CUDA_RESERVE = 3 * GiB
# A rank's Python, torch and its libraries, resident on a CPU host (measured: docs/memory.md).
CPU_RANK_RUNTIME = 0.45 * GiB
# TCP's share of a link (measured on the testbed: 95.6%) and round trips a round costs outside
# its exchange (gathering, begin, vote, commit: docs/wan.md).
LINK_EFFICIENCY = 0.95
ROUND_TRIPS = 8


@dataclass(frozen=True)
class Mode:
    """One inner-loop memory mode: the ``[inner]`` settings it is."""

    name: str
    param_dtype: str = "fp32"
    optimizer_state: str = "auto"
    offload: str = "none"

    @property
    def param_bytes(self) -> float:
        return 2.0 if self.param_dtype == "bf16" else 4.0

    @property
    def state_bytes(self) -> float:
        """Both AdamW moments, per parameter (8-bit: a code each and an fp32 scale per 256)."""
        kind = self.param_dtype if self.optimizer_state == "auto" else self.optimizer_state
        return {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 + 8.0 / 256}[kind]

    def settings(self) -> dict:
        return {"inner.param_dtype": self.param_dtype, "inner.optimizer_state": self.optimizer_state,
                "inner.offload": self.offload}


MODES = (
    Mode("fp32 masters"),
    Mode("fp32 + 8-bit AdamW", optimizer_state="8bit"),
    Mode("bf16", param_dtype="bf16"),
    Mode("bf16 + 8-bit AdamW", param_dtype="bf16", optimizer_state="8bit"),
    Mode("fp32, offload optimizer", offload="optimizer"),
    Mode("fp32, offload all", offload="all"),
)


@dataclass
class Shape:
    """A model's sizes as the node's sharding sees them."""

    params: int  # all parameters (tied ones once)
    rank_params: int  # the largest rank's share (FSDP2 rows)
    block_params: int  # the largest decoder block, unsharded
    root_params: int  # what is not in a block (embeddings, final norm, output layer)
    layers: int
    hidden: int
    kv_hidden: int
    intermediate: int
    vocab: int
    architecture: str


def model_shape(source: str, world: int) -> Shape:
    """``source`` (a preset or hf:PATH, config only) built on the meta device, sharded over ``world``
    ranks as FSDP2 shards it."""
    from trainer.config import ModelConfig
    from trainer.model import _empty_model, _empty_preset, read_hf_config
    from trainer.parallel import _blocks, rows_of

    cfg = ModelConfig(source=source)
    if cfg.hf_path is None:
        module = _empty_preset(source, on_meta=True)
        text = None
    else:
        config = read_hf_config(cfg.hf_path)
        module = _empty_model(config, on_meta=True)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = list(module.parameters())  # tied parameters once
    blocks = _blocks(module)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    rank_params = max(sum(_rows(p.shape, rows_of, r, world) for p in params) for r in range(world))
    hidden = module.get_input_embeddings().weight.shape[1]
    vocab = module.get_input_embeddings().weight.shape[0]
    fields = getattr(module, "fields", None) or {}

    def attr(name, default):
        return getattr(text, name, None) or fields.get(name) or default

    heads = attr("num_attention_heads", 1)
    kv_heads = attr("num_key_value_heads", heads)
    head_dim = attr("head_dim", hidden // heads)
    return Shape(params=sum(p.numel() for p in params), rank_params=rank_params,
                 block_params=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
                 root_params=sum(p.numel() for p in params if id(p) not in in_blocks), layers=len(blocks),
                 hidden=hidden, kv_hidden=kv_heads * head_dim, intermediate=attr("intermediate_size", 4 * hidden),
                 vocab=vocab, architecture=type(module).__name__)


def _rows(shape, rows_of, rank: int, world: int) -> int:
    if len(shape) == 0:
        return 1 if rank == 0 else 0
    rows = rows_of(shape[0], rank, world)
    return (rows.stop - rows.start) * math.prod(shape[1:])


@dataclass
class Hardware:
    device: str = "cuda"  # cuda | cpu
    gpu_memory: float = 80 * GiB  # per GPU (a CPU host: unused, its ranks share host_memory)
    host_memory: float = 1536 * GiB
    tflops: float = 989.0  # dense bf16 peak per GPU
    mfu: float = 0.4  # model FLOPs utilization the compute estimate assumes
    nproc: int = 8
    link_bps: float = 1e9  # each way
    rtt: float = 0.1
    pcie_bps: float = 25e9  # host <-> GPU, per GPU, for offload


@dataclass
class Run:
    batch_size: int = 16  # sequences per rank per inner step
    seq_len: int = 4096
    inner_steps: int = 500
    peers: int = 8
    codec: str = "int8"
    loss_chunk: int = 0  # 0 = the whole batch's logits
    catchup_rounds: int = 4
    state_on_disk: bool = False  # outer.state_dir


@dataclass
class ModePlan:
    mode: str
    settings: dict
    activation_checkpointing: bool
    gpu: dict  # per GPU, bytes
    gpu_total: float
    host: dict  # per host, bytes
    host_total: float
    fits: bool
    why_not: str = ""
    step_seconds: float = 0.0
    round_compute_seconds: float = 0.0
    utilization: float = 0.0  # without overlap
    utilization_overlapped: float = 0.0  # eager overlap
    recommended: bool = False


@dataclass
class Plan:
    model: str
    shape: dict
    hardware: dict
    run: dict
    sync: dict  # codec -> bytes and seconds per round
    modes: list[ModePlan] = field(default_factory=list)
    start_seconds: dict = field(default_factory=dict)

    @property
    def recommended(self) -> ModePlan | None:
        return next((m for m in self.modes if m.recommended), None)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["recommended"] = None if self.recommended is None else self.recommended.mode
        return out


def activation_bytes(shape: Shape, tokens: int, act_bytes: float, checkpointing: bool) -> float:
    """What one rank's forward keeps for its backward, for ``tokens`` tokens (estimate).

    Per token and decoder layer, a Llama-style block keeps: each RMSNorm's input upcast to fp32
    and its output (2 x (4h + 2h)/2-byte units), q and k before and after the rotary embedding
    (2(h + kv)), v (kv), the attention output (h, flash/SDPA kernels keep no scores), the MLP's
    gate, up, activation and product (4i): 18h + 6kv + 8i bytes in bf16 (x2 in fp32). With
    per-block checkpointing a block keeps its input only (h), and one block's full set exists
    while it is recomputed."""
    h, kv, i = shape.hidden, shape.kv_hidden, shape.intermediate
    unit = act_bytes / 2  # the figures above are bf16 bytes
    per_layer = (18 * h + 6 * kv + 8 * i) * unit
    if checkpointing:
        return tokens * (shape.layers * h * act_bytes + per_layer)
    return tokens * shape.layers * per_layer


def loss_bytes(shape: Shape, tokens: int, chunk: int, act_bytes: float) -> float:
    """The output layer's logits and the loss's fp32 copy and gradient (estimate): per token and
    vocabulary entry the logits in the compute dtype, their fp32 upcast and its gradient."""
    rows = min(tokens, chunk) if chunk else tokens
    return rows * shape.vocab * (act_bytes + 4 + 4)


def plan_run(source: str, hw: Hardware, run: Run, *, shape: Shape | None = None,
             modes: tuple[Mode, ...] = MODES) -> Plan:
    from p2p.codecs import get_codec
    from p2p.compression import exchange_bytes

    shape = shape or model_shape(source, hw.nproc)
    gpu_side = hw.device == "cuda"
    act_bytes = 2.0 if gpu_side else 4.0  # bf16 compute on GPUs, fp32 on CPUs (inner.precision auto)
    tokens = run.batch_size * run.seq_len
    # Sync: each peer sends its encoded vector's parts to their owners and the averaged parts
    # back: (M-1)/M of the encoded model each way (the butterfly of p2p/group.py; a sparse
    # codec's average has a format of its own).
    sync = {}
    for name in dict.fromkeys(("fp32", "bf16", "int8", "int4", "sparse", run.codec)):
        wire = exchange_bytes(get_codec(name), shape.params, run.peers) if run.peers > 1 else 0.0
        seconds = wire * 8 / (hw.link_bps * LINK_EFFICIENCY) + ROUND_TRIPS * hw.rtt
        sync[name] = {"bytes_per_peer": wire, "seconds": seconds}
    codec = get_codec(run.codec)
    plan = Plan(model=source, shape=asdict(shape), hardware=asdict(hw), run=asdict(run), sync=sync)
    # Step time: 6 FLOPs per parameter and token (4/3 of it again to recompute checkpointed blocks).
    flops_per_step = 6 * shape.params * tokens * hw.nproc
    peak = hw.nproc * hw.tflops * 1e12 * hw.mfu
    world = hw.nproc
    for mode in modes:
        if mode.offload == "optimizer" and world > 1:
            continue  # one GPU only (trainer/memory.py)
        if mode.offload == "all" and world < 2:
            continue
        for checkpointing in (False, True):
            gpu = {}
            on_device = mode.offload == "none"
            p = shape.rank_params
            gpu["parameters"] = p * mode.param_bytes if mode.offload != "all" else 0.0
            gpu["gradients"] = p * mode.param_bytes if on_device else 0.0
            gpu["optimizer_state"] = p * mode.state_bytes if on_device else 0.0
            # FSDP2 all-gathers a block in the compute dtype (the next one prefetched) and reduces
            # its gradient in fp32; the root's parameters (embeddings, output layer) stay gathered
            # from its forward to its backward.
            gather = act_bytes if hw.device == "cuda" else mode.param_bytes
            gpu["gather_buffers_estimate"] = (2 * shape.block_params * gather + shape.block_params * 4
                                              + shape.root_params * gather) if world > 1 else 0.0
            gpu["activations_estimate"] = activation_bytes(shape, tokens, act_bytes, checkpointing)
            gpu["loss_estimate"] = loss_bytes(shape, tokens, run.loss_chunk, act_bytes)
            if gpu_side:
                gpu["runtime_reserve"] = CUDA_RESERVE
            gpu_total = sum(gpu.values())
            # Host: the outer state of every rank's shard (θ, momentum, error-feedback residual for
            # a lossy codec, the round's encoded average, the kept averages for catch-up), and what
            # the mode offloads.
            n = shape.params
            host = {}
            lossy = codec.name not in ("fp32",)
            if run.state_on_disk:
                host["outer_state"] = 3.0 * n  # measured: docs/benchmarks.md#outerstate
            else:
                host["outer_state"] = n * (4 + 4 + (4 if lossy else 0))
            host["round_average"] = codec.average.wire_bytes(n)
            if world > 1:  # each rank's encoded Δ, handed to rank 0 for the host's exchange
                host["round_inputs"] = codec.wire_bytes(n)
            # Kept for joiners' catch-up by single-rank hosts (multi-rank hosts keep none).
            host["kept_averages"] = run.catchup_rounds * codec.average.wire_bytes(n) if world == 1 else 0.0
            if mode.offload == "all":
                host["offloaded"] = n * (mode.param_bytes * 2 + mode.state_bytes)
            elif mode.offload == "optimizer":
                host["offloaded"] = n * (mode.param_bytes + mode.state_bytes)
            if not gpu_side:  # a CPU host's ranks live in the same memory
                host["ranks"] = world * (gpu_total + CPU_RANK_RUNTIME)
            host_total = sum(host.values())
            why = ""
            if gpu_side and gpu_total > hw.gpu_memory:
                why = f"needs {gpu_total / GiB:.1f} GiB per GPU, has {hw.gpu_memory / GiB:.0f}"
            elif host_total > hw.host_memory:
                why = f"needs {host_total / GiB:.0f} GiB of host memory, has {hw.host_memory / GiB:.0f}"
            step = flops_per_step * (4 / 3 if checkpointing else 1) / peak
            if mode.offload == "all":  # sharded params in, gradients out, over PCIe, each step
                step += 3 * shape.rank_params * mode.param_bytes / hw.pcie_bps
            if mode.offload != "none":  # AdamW on the host: ~2 x 16 bytes a parameter through memory
                step += shape.rank_params * 32 / 20e9
            compute = step * run.inner_steps
            sync_s = sync[codec.name]["seconds"]
            plan.modes.append(ModePlan(
                mode=mode.name, settings={**mode.settings(), "model.activation_checkpointing": checkpointing,
                                          "inner.loss_chunk": run.loss_chunk},
                activation_checkpointing=checkpointing, gpu=gpu, gpu_total=gpu_total, host=host,
                host_total=host_total, fits=not why, why_not=why, step_seconds=step, round_compute_seconds=compute,
                utilization=compute / (compute + sync_s), utilization_overlapped=min(1.0, compute / max(sync_s, 1e-9))))
    # The recommendation: the fastest mode that fits, the more precise of equally fast ones
    # (MODES is in that order; checkpointing and offload cost time).
    fitting = [m for m in plan.modes if m.fits]
    if fitting:
        best = min(fitting, key=lambda m: (round(m.step_seconds, 6), plan.modes.index(m)))
        best.recommended = True
    plan.start_seconds = start_estimate(shape, hw)
    return plan


def start_estimate(shape: Shape, hw: Hardware, disk_bps: float = 2e9, hash_bps: float = 1e9) -> dict:
    """Seconds a start costs before the first step (estimate): reading bf16 weights by rows (each
    rank its own rows, from one disk), hashing θ for the run's fingerprint (each rank its shard, in
    parallel)."""
    read = shape.params * 2 / disk_bps
    hashing = shape.rank_params * 4 / hash_bps
    return {"read_weights": read, "hash_theta": hashing, "total": read + hashing}


def host_memory_bytes() -> float:
    """This host's RAM (MemTotal)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    raise OSError("no MemTotal in /proc/meminfo")


def fit_error(config, device: str) -> str | None:
    """Why this host cannot hold the model in the node's own memory mode, as one line naming
    ``model.source``, or None. Only what is certain counts (the parameters, their gradients and
    optimizer state, the outer state): activations are estimates and never refuse a start."""
    import torch

    inner, host = config.inner, config.host
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        return None  # the device check that follows says so (node/launch.py, node/daemon.py)
    mode = Mode("the configured mode", param_dtype=inner.param_dtype, optimizer_state=inner.optimizer_state,
                offload=inner.offload)
    gpu_memory = torch.cuda.get_device_properties(torch.device(device)).total_memory if cuda else 0.0
    hw = Hardware(device="cuda" if cuda else "cpu", gpu_memory=gpu_memory, host_memory=host_memory_bytes(),
                  nproc=host.nproc_per_node)
    shape = model_shape(config.model.source, host.nproc_per_node)
    run = Run(batch_size=1, seq_len=1, peers=2, codec=config.swarm.codec, catchup_rounds=config.swarm.catchup_rounds,
              state_on_disk=bool(config.outer.state_dir))
    plan = plan_run(config.model.source, hw, run, shape=shape, modes=(mode,))
    if not plan.modes:
        return None
    m = plan.modes[0]
    held = ("parameters", "gradients", "optimizer_state")
    settings = f"inner.param_dtype = {inner.param_dtype}, inner.optimizer_state = {inner.optimizer_state}, " \
               f"inner.offload = {inner.offload}"
    if cuda and sum(m.gpu[k] for k in held) + CUDA_RESERVE > gpu_memory:
        need = sum(m.gpu[k] for k in held) + CUDA_RESERVE
        return (f"model.source: {config.model.source} ({shape.params / 1e9:.2f}B parameters) does not fit: its "
                f"parameters, gradients and optimizer state need {need / GiB:.1f} GiB per GPU with {settings}, "
                f"a GPU here has {gpu_memory / GiB:.1f} (`gonka-node plan` shows the modes that fit)")
    host_need = m.host["outer_state"] + m.host.get("offloaded", 0.0)
    if not cuda:
        host_need += host.nproc_per_node * (sum(m.gpu[k] for k in held) + CPU_RANK_RUNTIME)
    if host_need > hw.host_memory:
        return (f"model.source: {config.model.source} ({shape.params / 1e9:.2f}B parameters) does not fit: it "
                f"needs {host_need / GiB:.1f} GiB of host memory with {settings}, this host has "
                f"{hw.host_memory / GiB:.1f} (`gonka-node plan` shows the modes that fit; outer.state_dir "
                f"keeps the outer state on disk)")
    return None
