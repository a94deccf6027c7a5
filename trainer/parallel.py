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
    mode: str  # fsdp
    device: torch.device

    @property
    def layout(self) -> str:
        """The host's shard layout, as the run's fingerprint records it."""
        return f"{self.mode}x{self.world}"

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any (a collective: every rank calls it)."""
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


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


def shard_model(module: nn.Module, ranks: Ranks, precision: str) -> nn.Module:
    """FSDP2 over the host's ranks; bf16 compute with fp32 gradients reduced when asked (the
    sharded parameters themselves stay fp32). Tied embeddings are one parameter of the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    module.to(ranks.device)
    for block in _blocks(module):
        fully_shard(block, mp_policy=policy)
    # The root too gives its parameters back after a forward: an evaluation (no backward) must
    # leave every parameter sharded, as the outer state pairs with the shards.
    fully_shard(module, mp_policy=policy, reshard_after_forward=True)
    return module


def resharded(module: nn.Module) -> None:
    """Every FSDP unit of ``module`` back to its sharded parameters (a no-op where they are)."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def local_tensors(params) -> list[torch.Tensor]:
    """This rank's part of each parameter: the local shard of a sharded one (a view that
    writes through), the parameter itself otherwise."""
    return [p.to_local() if hasattr(p, "to_local") else p for p in params]


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
