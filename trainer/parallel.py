"""One host's local ranks: PyTorch's process group, the model sharded over it, and the slice
of the parameters each rank keeps the outer state of and syncs with the swarm.

A host with ``host.nproc_per_node`` = N runs N processes under ``torch.distributed.run``. The
inner loop is FSDP2's: ``fully_shard`` on every decoder layer and on the root, so each rank
holds 1/N of every parameter (dim-0 rows), of its gradient and of AdamW's state, and the
forward/backward all-gathers and reduce-scatters them. The rank's local shards are also what
it keeps the outer state of (θ, momentum, error-feedback residual, fp32 in host RAM) and
averages with rank k of the other hosts: no process ever holds the whole model's outer state,
and nothing crosses between ranks at a round boundary. Shards are a function of N and the
model only, so rank k of every host of a run (one layout, covered by the fingerprint) holds
the same slice.

With ``host.parallel = ddp`` every rank trains a whole replica under DDP (models that fit one
device: no all-gather per block, one gradient all-reduce per step) and still keeps the outer
state of, and syncs, only the rows FSDP2 would give it: the same slices, the same checkpoint
parts, the same export. After a rank writes its slice of the local copy (a new θ, a loaded
state, an evaluation) every rank broadcasts its slice to the others, so the replicas stay one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

# What torch.distributed.run sets in every rank's environment.
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(slots=True)
class Ranks:
    """This process's place on its host."""

    rank: int
    world: int
    mode: str  # fsdp | ddp
    device: torch.device

    @property
    def layout(self) -> str:
        """The host's shard layout, as the run's fingerprint records it."""
        return f"{self.mode}x{self.world}"

    def any(self, *flags: bool) -> tuple[bool, ...] | bool:
        """For each flag, True on every rank if it is True on any (one all-reduce: a collective,
        every rank calls it with as many flags). One flag: one bool."""
        t = torch.tensor([1.0 if f else 0.0 for f in flags])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out = tuple(bool(v) for v in t.tolist())
        return out[0] if len(out) == 1 else out


def launched() -> bool:
    """Whether this process is a rank started by torch.distributed.run."""
    return all(k in os.environ for k in RANK_ENV)


def init_ranks(mode: str, device: str) -> Ranks:
    """Join the host's process group (gloo on CPU; NCCL for CUDA tensors, gloo for the CPU ones)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda"):
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        backend = "cpu:gloo,cuda:nccl"
    else:
        dev = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=dev if dev.type == "cuda" else None)
    return Ranks(rank, world, mode, dev)


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, each one FSDP unit: the classes a Hugging Face model lists
    as never to be split (its decoder layers)."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    return [m for m in module.modules() if type(m).__name__ in names]


def wrap_model(module: nn.Module, ranks: Ranks, precision: str, *, offload: bool = False) -> nn.Module:
    """The host's model over its ranks, as ``ranks.mode`` says (FSDP2 shards or DDP replicas)."""
    if ranks.mode == "ddp":
        return replicate_model(module, ranks)
    return shard_model(module, ranks, precision, offload=offload)


def replicate_model(module: nn.Module, ranks: Ranks) -> nn.Module:
    """DDP over the host's ranks: a whole replica each (bf16 is the loss's autocast), and
    no buffer broadcast per forward (the models' buffers are computed, equal on every rank)."""
    from torch.nn.parallel import DistributedDataParallel

    module.to(ranks.device)
    ids = [ranks.device.index] if ranks.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False)


def shard_model(module: nn.Module, ranks: Ranks, precision: str, *, offload: bool = False) -> nn.Module:
    """FSDP2 over the host's ranks; bf16 compute with fp32 gradients reduced when asked (the
    sharded parameters keep their own dtype). Tied embeddings are one parameter of the root.
    ``offload``: FSDP2's CPUOffloadPolicy (``inner.offload = all``): the sharded parameters, their
    gradients and the optimizer's state stay in host RAM, each block copied to the device for
    its forward and backward."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    placement = CPUOffloadPolicy(pin_memory=ranks.device.type == "cuda") if offload else OffloadPolicy()
    home = torch.device("cpu") if offload else ranks.device
    on_meta = any(p.is_meta for p in module.parameters())
    buffers = {name: b for name, b in module.named_buffers()}
    if not on_meta:
        module.to(home)
    for block in _blocks(module):
        fully_shard(block, mp_policy=policy, offload_policy=placement)
    # The root too gives its parameters back after a forward: an evaluation (no backward) must
    # leave every parameter sharded, as the outer state pairs with the shards.
    fully_shard(module, mp_policy=policy, offload_policy=placement, reshard_after_forward=True)
    if on_meta:  # each rank allocates its shards only (the caller fills them); buffers keep their values
        module.to_empty(device=home)
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
    if offload and ranks.device.type == "cuda":  # buffers (rotary tables) where the compute is
        for name, b in module.named_buffers():
            b.data = b.data.to(ranks.device)
    return module


def compile_blocks(module: nn.Module) -> None:
    """``torch.compile`` each decoder block in place (``inner.compile``): the blocks are where the
    FLOPs are, and compiling them one by one keeps FSDP2's hooks and activation checkpointing
    around each block outside the compiled graph."""
    for block in _blocks(module):
        block.compile()


def resharded(module: nn.Module) -> None:
    """Every FSDP unit of ``module`` back to its sharded parameters (a no-op where they are)."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def local_part(module: nn.Module, ranks: Ranks | None) -> list[torch.Tensor]:
    """The tensors of ``module`` that θ pairs with: the whole parameters, or this rank's shards
    (FSDP2's, or its slices of a DDP replica, wrapped or not yet)."""
    if ranks is not None and ranks.mode == "ddp":
        return replica_slices(module.parameters(), ranks)
    if ranks is not None:
        resharded(module)
    return local_tensors(module.parameters())


def local_tensors(params) -> list[torch.Tensor]:
    """This rank's part of each parameter: the local shard of a sharded one (a view that
    writes through), the parameter itself otherwise."""
    return [local_tensor(p) for p in params]


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded parameter (a DTensor), the parameter itself otherwise."""
    return p.to_local() if hasattr(p, "to_local") else p


def own_rows(p: torch.Tensor) -> slice:
    """The dim-0 rows of a parameter this rank holds: its FSDP2 shard's, or all of them."""
    mesh = getattr(p, "device_mesh", None)
    return slice(0, p.shape[0]) if mesh is None else rows_of(p.shape[0], mesh.get_local_rank(), mesh.size())


def rows_of(rows: int, rank: int, world: int) -> slice:
    """The dim-0 rows of ``rows`` that ``rank`` holds: FSDP2's Shard(0) chunks (torch.chunk's
    sizes; ranks past the last chunk hold none)."""
    size = -(-rows // world)
    start = min(rows, rank * size)
    return slice(start, min(rows, start + size))


def replica_slice(p: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """``rank``'s rows of a replicated parameter: a view that writes through (a 0-d one is
    rank 0's, as one row)."""
    t = p.detach()
    if t.dim() == 0:
        t = t.view(1)
    return t[rows_of(t.shape[0], rank, world)]


def replica_slices(params, ranks: Ranks) -> list[torch.Tensor]:
    """This rank's slice of each replicated parameter (what a DDP rank keeps the outer state of)."""
    return [replica_slice(p, ranks.rank, ranks.world) for p in params]


@torch.no_grad()
def sync_replicas(params, ranks: Ranks) -> None:
    """Every rank's slices to every other rank (one broadcast per rank, its slices packed):
    after each rank wrote its own, every replica is whole and the same. A collective."""
    params = list(params)
    for owner in range(ranks.world):
        views = [v for v in (replica_slice(p, owner, ranks.world) for p in params) if v.numel()]
        if not views:
            continue
        dtypes = {v.dtype for v in views}
        assert len(dtypes) == 1, f"replicated parameters of one dtype, got {dtypes}"
        if owner == ranks.rank:
            flat = torch.cat([v.reshape(-1) for v in views])
        else:
            flat = torch.empty(sum(v.numel() for v in views), dtype=views[0].dtype, device=views[0].device)
        dist.broadcast(flat, src=owner)
        if owner != ranks.rank:
            at = 0
            for v in views:
                v.copy_(flat[at:at + v.numel()].view_as(v))
                at += v.numel()


def local_optimizer_state(state_dict: dict) -> dict:
    """An optimizer's state_dict with each sharded tensor as this rank's local shard: what a
    rank's checkpoint part holds (plain tensors, loadable with weights_only)."""
    state = {k: {n: (v.to_local() if hasattr(v, "to_local") else v) for n, v in s.items()}
             for k, s in state_dict["state"].items()}
    return {"state": state, "param_groups": state_dict["param_groups"]}


def reshard_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` of a ``local_optimizer_state``: every per-element state of a
    sharded parameter becomes a shard of it again."""
    from torch.distributed.tensor import DTensor

    for group in opt.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            state = opt.state.get(p, {})
            for k, v in list(state.items()):
                if torch.is_tensor(v) and not isinstance(v, DTensor) and v.dim() > 0:
                    state[k] = DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements,
                                                  run_check=False, shape=p.shape, stride=p.stride())
