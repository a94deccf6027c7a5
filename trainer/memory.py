"""The inner loop's memory modes: what the local copy's parameters and AdamW's state are kept in,
and where (``[inner] param_dtype``, ``optimizer_state``, ``offload``; docs/memory.md).

Each mode is the PyTorch ecosystem's own implementation, chosen for what it keeps off the GPU:

- bf16 parameters: AdamW from torchao with stochastic rounding of each update to bf16
  (``bf16_stochastic_round``): an update smaller than half a bf16 step moves the parameter with
  the right probability instead of never, so H steps of small updates add up in expectation.
  The swarm's θ and momentum stay fp32 on the host; the local copy starts each round from θ
  rounded to bf16, and its pseudo-gradient is its own movement (trainer/diloco.py ``_delta``).
- 8-bit moments: torchao's block-wise quantized AdamW state (dynamic-tree codes, one scale per
  256 values), 2 bytes a parameter for both moments instead of 8. Its state reads as fp32
  whatever the parameters' dtype (torchao 0.18's bf16-typed 8-bit state cannot be read back
  as fp32 inside its own step), and the update of bf16 parameters is rounded stochastically.
- optimizer offload: torchao's ``CPUOffloadOptimizer`` (fp32 AdamW state in host RAM, its step
  on the CPU, copies overlapped on a side stream): one CUDA device.
- full offload: FSDP2's ``CPUOffloadPolicy`` (sharded parameters, gradients and state in host
  RAM; all-gathers copy each block to the GPU): FSDP2 ranks (trainer/parallel.py).
"""

from __future__ import annotations

import threading

import torch

from trainer.config import HostConfig, InnerConfig


def prepare(module: torch.nn.Module, inner: InnerConfig) -> torch.nn.Module:
    """The model before it is placed, sharded or wrapped: its chunked loss head and compiled
    blocks, as the inner loop's settings ask (FSDP2 keeps references to the modules it manages)."""
    from trainer.loss import install_chunked_loss
    from trainer.parallel import compile_blocks

    if inner.loss_chunk:
        install_chunked_loss(module, inner.loss_chunk)
    if inner.compile:
        compile_blocks(module)
    return module


def place(module: torch.nn.Module, inner: InnerConfig, ranks, device: torch.device, precision: str, *,
          sharded: bool) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The local copy on its device (a whole model, FSDP2 shards or a DDP replica) in its memory
    mode, and θ: fp32 copies of this rank's part of the parameters as loaded, so every mode starts
    from the same θ. ``sharded``: ``module`` is FSDP2's already (prepared before it was sharded)."""
    from trainer.parallel import local_part, wrap_model

    dtype = param_dtype(inner)
    if not sharded:
        module = prepare(module, inner)
    if ranks is not None and ranks.mode == "ddp":  # the replica in its dtype before DDP sees it
        theta = _fp32_copies(local_part(module, ranks))
        return wrap_model(module.to(dtype), ranks, precision), theta
    if ranks is None:
        model = module.to(device)
    else:
        model = module if sharded else wrap_model(module, ranks, precision, offload=inner.offload == "all")
    theta = _fp32_copies(local_part(model, ranks))
    if dtype != torch.float32:
        model.to(dtype)
    return model, theta


def _fp32_copies(tensors) -> list[torch.Tensor]:
    return [t.detach().to("cpu", torch.float32, copy=True) for t in tensors]


def check_modes(inner: InnerConfig, host: HostConfig, device: str) -> None:
    """A mode this host cannot run: ValueError naming the key (exit code 2 before anything loads).
    ``device``: cpu or cuda[:N] (auto resolved)."""
    if inner.offload == "optimizer":
        if not device.startswith("cuda"):
            raise ValueError("inner.offload: optimizer offload moves AdamW's state off a CUDA device; "
                             f"this node trains on {device} (use none, or all with FSDP2 ranks)")
        if host.nproc_per_node > 1:
            raise ValueError("inner.offload: optimizer offload serves one device (host.nproc_per_node = 1); "
                             "with FSDP2 ranks use all")
    if inner.offload == "all" and (host.nproc_per_node < 2 or host.parallel != "fsdp"):
        raise ValueError("inner.offload: all is FSDP2's CPU offload: it needs host.parallel = fsdp and "
                         f"host.nproc_per_node >= 2 (got {host.parallel} x {host.nproc_per_node})")
    if inner.state_kind != "fp32" or inner.param_dtype != "fp32":
        _torchao()  # the low-precision modes are torchao's


def torchao_optim():
    """``torchao.optim``, its 8-bit state's class allowed in weights-only checkpoint loads (its
    start-up warnings are silenced in trainer/__init__.py)."""
    import torchao.optim as ao
    from torchao.optim.subclass_8bit import OptimState8bit

    # A checkpoint's 8-bit AdamW state: codes and scales, rebuilt as torchao's class (no code runs).
    torch.serialization.add_safe_globals([OptimState8bit])
    return ao


def _torchao():
    try:
        return torchao_optim()
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ValueError(f"inner.optimizer_state: needs torchao ({exc})") from None


def inner_optimizer(groups: list[dict], inner: InnerConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over ``groups`` in the mode ``inner`` names (its lr set per step with ``set_lr``)."""
    kw = dict(lr=inner.lr, betas=(inner.beta1, inner.beta2))
    on_cuda = device.type == "cuda"
    if inner.offload == "optimizer":
        ao = _torchao()
        return ao.CPUOffloadOptimizer(groups, torch.optim.AdamW, offload_gradients=True, fused=True, **kw)
    if inner.state_kind == "8bit":
        return _adamw_8bit()(groups, bf16_stochastic_round=inner.param_dtype == "bf16", **kw)
    if inner.param_dtype == "bf16":
        return _eager_on_cpu(_torchao()._AdamW)(groups, bf16_stochastic_round=True, **kw)
    # fp32: one fused kernel per step on GPUs; the per-tensor loop on CPU (where foreach buys nothing).
    return torch.optim.AdamW(groups, fused=True if on_cuda else None, foreach=False if not on_cuda else None, **kw)


def _adamw_8bit():
    """torchao's AdamW8bit, its 8-bit state read as fp32 (see the module's docstring)."""
    ao = _torchao()
    from torchao.optim.subclass_8bit import OptimState8bit

    class AdamW8bitFp32State(_eager_on_cpu(ao.AdamW8bit)):

        @staticmethod
        def _subclass_zeros(p: torch.Tensor, signed: bool, block_size: int):
            return OptimState8bit.zeros(p.shape, signed, block_size, p.device, dtype=torch.float32)

        def load_state_dict(self, state_dict: dict) -> None:
            # torch's loader gives every state tensor its parameter's dtype; for the 8-bit state
            # that is only how it reads (the codes stay), and it must read as fp32 again.
            super().load_state_dict(state_dict)
            for state in self.state.values():
                for key, value in state.items():
                    if isinstance(value, OptimState8bit) and value.dtype != torch.float32:
                        state[key] = value.to(torch.float32)

    return AdamW8bitFp32State


# torchao's optimizers torch.compile their step on first use, and Dynamo is not thread-safe: the
# simulator's workers train on threads of one process (a node trains on one), so their steps
# take turns. Uncontended in a node.
_COMPILED_STEPS = threading.Lock()


def step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()``; one at a time in this process for the optimizers whose step is compiled."""
    if getattr(opt, "compiled_step", False):
        with _COMPILED_STEPS:
            opt.step()
    else:
        opt.step()


def _eager_on_cpu(base: type) -> type:
    """torchao's AdamW ``base``, its step run as it is (not compiled) on CPU parameters.

    torchao compiles each parameter's update (``torch.compile`` of ``single_param_adam``): on a GPU
    one fused kernel per parameter. On a CPU it builds C++ kernels first, 8-25 s of a process's
    start for a model of a few tensors, for a step that is memory-bound either way; there the same
    function runs eagerly, on the same state (the 8-bit state's own operators quantize it)."""
    from torchao.optim.adam import single_param_adam

    class EagerOnCpu(base):
        compiled_step = True  # on a GPU (trainer/memory.py ``step``)

        @torch.no_grad()
        def step(self, closure=None):
            if any(p.device.type != "cpu" for group in self.param_groups for p in group["params"]):
                return super().step(closure)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                        if group["amsgrad"]:
                            state["max_exp_avg_sq"] = self._new_buffer(p, False)
                    state["step"] += 1
                    single_param_adam(p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                                      state.get("max_exp_avg_sq"), group["lr"], group["betas"][0], group["betas"][1],
                                      group["weight_decay"], group["eps"], self.is_adamw,
                                      self.bf16_stochastic_round and p.dtype is torch.bfloat16)
            return loss

    EagerOnCpu.__name__ = EagerOnCpu.__qualname__ = f"{base.__name__}EagerOnCpu"
    return EagerOnCpu


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """The learning rate of every group (torchao's optimizers keep it as a tensor, set in place)."""
    for group in opt.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def param_dtype(inner: InnerConfig) -> torch.dtype:
    return torch.bfloat16 if inner.param_dtype == "bf16" else torch.float32
