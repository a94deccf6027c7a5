"""One DiLoCo worker: the state a peer holds and the steps it takes.

The worker holds the swarm-wide state (global parameters θ and outer momentum,
fp32 on CPU, bit-identical on every peer) next to its local working copy on the
accelerator with its own AdamW state, which is never averaged. Its operations
(inner steps, pseudo-gradient, outer step, overlapped starts and landings) are
blocking calls; the round that strings them together, in the swarm and in the
simulator alike, is ``trainer.round.PeerRounds``.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.data import ShardSampler
from trainer.fingerprint import Fingerprint, run_fingerprint
from trainer.inithash import init_hash
from trainer.landing import Landing
from trainer.memory import inner_optimizer, place, prepare, set_lr
from trainer.memory import step as optimizer_step
from trainer.model import LoadedModel, check_vocab, load_model, lm_loss
from trainer.outer import OuterOptimizer
from trainer.parallel import (Ranks, local_optimizer_state, local_part, reshard_optimizer_state, shard_model,
                              sync_replicas)
from trainer.schedule import inner_lr

@dataclass
class InnerStats:
    steps: int
    tokens: int
    mean_loss: float
    seconds: float

    def __add__(self, other: "InnerStats") -> "InnerStats":
        steps = self.steps + other.steps
        loss_sum = sum(s.mean_loss * s.steps for s in (self, other) if s.steps)
        return InnerStats(steps=steps, tokens=self.tokens + other.tokens,
                          mean_loss=loss_sum / steps if steps else float("nan"),
                          seconds=self.seconds + other.seconds)


def _check_tensors(tensors, like: list[torch.Tensor], key: str) -> None:
    if not isinstance(tensors, list) or len(tensors) != len(like):
        raise ValueError(f"{key}: expected a list of {len(like)} tensors")
    for i, (t, ref) in enumerate(zip(tensors, like)):
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            raise ValueError(f"{key}: tensor {i} must be {ref.dtype} of shape {tuple(ref.shape)}")


def _delta(start: torch.Tensor, local: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One tensor's Δ = start − θ_local, fp32 on the CPU (into ``out`` if given). A bf16 local copy
    started from ``start`` rounded to bf16 (``copy_``): Δ is taken from there, its own movement, so
    that rounding is not sent as if it were training."""
    here = local.detach().to("cpu", torch.float32)
    if local.dtype != torch.float32:
        start = start.to(local.dtype).to(torch.float32)
    return torch.sub(start, here, out=out)


class DiLoCoWorker:
    """Global state θ and momentum, plus this peer's local model, AdamW and data stream."""

    def __init__(
        self,
        *,
        model: ModelConfig,
        data: DataConfig,
        inner: InnerConfig,
        outer: OuterConfig,
        corpus,
        shard_key: str,
        seed: int,
        device: str = "cpu",
        loaded: LoadedModel | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        """``ranks``: this process is one of a multi-rank host's ranks (trainer/parallel.py): the
        model is sharded over them, and θ, the momentum and the pseudo-gradient are this rank's
        shards only."""
        self.model_cfg, self.data_cfg, self.inner_cfg = model, data, inner
        self.ranks = ranks
        self.device = ranks.device if ranks is not None else torch.device(device)
        self.precision = inner.precision if inner.precision != "auto" else (
            "bf16" if self.device.type == "cuda" or inner.param_dtype == "bf16" else "fp32")
        offload = inner.offload == "all"
        # Same seed (or the same pretrained weights) on every peer: the swarm starts from one θ
        # with no download. ``loaded`` lets a caller that already built the model hand it over.
        # FSDP ranks shard it as it is built: a rank never holds the whole of a random init.
        sharded = ranks is not None and ranks.mode == "fsdp" and loaded is None
        if loaded is None:
            loaded = load_model(model, seed, shard=(lambda m: shard_model(prepare(m, inner), ranks, self.precision,
                                                                          offload=offload)) if sharded else None)
        self.loaded = loaded
        self.seq_len = data.seq_len or self.loaded.context
        if self.seq_len > self.loaded.context:
            raise ValueError(f"data.seq_len: {self.seq_len} exceeds the context of {model.source} "
                             f"({self.loaded.context} positions)")
        check_vocab(corpus, self.loaded)
        # θ from the parameters as loaded, then the local copy in its memory mode (trainer/memory.py).
        self.model, self.global_params = place(self.loaded.module, inner, ranks, self.device, self.precision,
                                               sharded=sharded)
        momentum_storage, self.mapped = None, None
        if outer.state_dir:  # θ and the momentum in memory-mapped files (trainer/hoststate.py)
            from trainer.hoststate import MappedState, mapped_like, views

            self.mapped = MappedState(outer.state_dir if ranks is None else
                                      os.path.join(outer.state_dir, f"rank{ranks.rank}"))
            self.global_params = mapped_like(self.mapped, "theta", self.global_params)
            momentum_storage = views(self.mapped.vector("momentum", sum(g.numel() for g in self.global_params)),
                                     [g.shape for g in self.global_params])
        if self.device.type == "cuda" and self.precision == "fp32":
            torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls: fp32 range, tensor-core speed
            torch.backends.cudnn.allow_tf32 = True
        # Matrices get weight decay; biases and norm gains do not (GPT-2 practice).
        params = list(self.model.parameters())
        self.inner_opt = inner_optimizer(
            [
                {"params": [p for p in params if p.dim() >= 2], "weight_decay": inner.weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            ],
            inner, torch.device("cpu") if offload else self.device)
        self.outer_cfg = outer
        self.outer_opt = OuterOptimizer(self.global_params, outer, momentum_storage)
        # Overlapped rounds: an average committed while the local copy trains moves the
        # local copy at a later step (trainer/landing.py); the lock orders the two threads.
        self._lock = threading.Lock()
        self.landing = Landing(global_params=self.global_params, land_step=lambda: self.outer_cfg.land_step,
                               ranks=ranks, lock=self._lock, local=self._local, local_written=self._local_written)
        self.sampler = ShardSampler(
            corpus,
            # Every rank of a host draws its own batches from the host's shard.
            shard_key=shard_key if ranks is None or ranks.world == 1 else f"{shard_key}/rank{ranks.rank}",
            seed=seed,
            batch_size=data.batch_size,
            seq_len=self.seq_len,
            eval_fraction=data.eval_fraction,
        )
        self._eval_batches = None
        self.round = 0
        self.inner_step = 0
        self._corpus = corpus
        # θ before any step or download: part of the run's fingerprint.
        # θ read from pretrained files is hashed once per set of files (trainer/inithash.py).
        layout = "single" if ranks is None else f"{ranks.layout}/rank{ranks.rank}"
        self.init_hash = init_hash(self.loaded.weight_files, layout, self.params_hash)

    def fingerprint(self, codec: str, rounds: str = "", init_hash: str = "") -> Fingerprint:
        """What every peer of this run must share (trainer/fingerprint.py). ``init_hash``: the
        whole host's initial θ, when this worker is one rank of it."""
        sharded = self.ranks is not None and self.ranks.world > 1
        return run_fingerprint(
            model_config=self.loaded.config, init_hash=init_hash or self.init_hash,
            tokenizer=getattr(self._corpus, "tokenizer_sha256", None) or "bytes",
            data=self.sampler.split_digest(), seq_len=self.seq_len, codec=codec,
            outer_lr=self.outer_cfg.lr, outer_momentum=self.outer_cfg.momentum, nesterov=self.outer_cfg.nesterov,
            rounds=rounds, layout=self.ranks.layout if sharded else "")

    def assign_data(self, run_key: str) -> None:
        """Draw this worker's batches by ``run_key``, the run's fingerprint digest
        (``Fingerprint.digest``), from now on instead of by the seed: every peer of the run (and
        a simulator given the same key) then reconstructs this peer's batches of any round
        (``ShardSampler.assigned_batches``, trainer/data.py)."""
        self.sampler.run_key = run_key

    # -- inner loop -------------------------------------------------------

    def train_for(self, round: int, step: int = 0) -> None:
        """The inner steps that follow train for ``round``, ``step`` of them taken already: their
        batches are steps ``step``, ``step + 1``, ... of this peer's assigned data of that round.

        ``round`` is the round whose average the pseudo-gradient of these steps goes into,
        numbered as its commit (certificate, history line, ``committed round=`` log line): with
        no round in flight ``self.round + 1``; with rounds overlapping, the round after the one
        in flight, whose outer step may land during these steps (``trainer.round.PeerRounds``
        says which). Calls of ``inner_steps`` without one in between continue the round's steps."""
        self.sampler.seek(round, step)

    @property
    def tokens_per_step(self) -> int:
        """Tokens one inner step trains on, over every rank of the host."""
        return self.data_cfg.batch_size * self.seq_len * (self.ranks.world if self.ranks is not None else 1)

    def _local(self) -> list[torch.Tensor]:
        """The local copy's tensors θ pairs with (trainer/parallel.py ``local_part``)."""
        return local_part(self.model, self.ranks)

    def _local_written(self) -> None:
        """After this rank wrote its part of the local copy: DDP replicas take every rank's part
        (a collective: every rank writes, then calls this)."""
        if self.ranks is not None and self.ranks.mode == "ddp":
            sync_replicas(self.model.parameters(), self.ranks)

    def inner_steps(self, n: int, should_stop: Callable[[], bool] | None = None) -> InnerStats:
        """Up to ``n`` AdamW steps on this worker's shard; blocking. Each step trains on the next
        batch of the round set by ``train_for`` (several calls within a round continue its
        steps). On a multi-rank host every rank takes the same steps: one that is told to stop
        stops them all at the next step, and an average of the round in flight lands on every
        rank at the same step."""
        start = time.perf_counter()
        self.model.train()
        # Losses add up on the device and are read once: no host sync per step.
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        steps = 0
        landing = self.landing
        gate = landing.host_gate if self.ranks is not None and self.ranks.world > 1 else landing.gate
        for _ in range(n):
            if not gate(should_stop):
                break
            x, y = self.sampler.next_batch()
            set_lr(self.inner_opt, inner_lr(self.inner_step, self.inner_cfg))
            loss = self._loss(x, y)
            self.inner_opt.zero_grad(set_to_none=True)
            loss.backward()
            if self.inner_cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner_cfg.grad_clip)
            optimizer_step(self.inner_opt)
            self.inner_step += 1
            loss_sum += loss.detach().float()
            steps += 1
        return InnerStats(
            steps=steps,
            tokens=steps * self.data_cfg.batch_size * self.seq_len,
            mean_loss=loss_sum.item() / steps if steps else float("nan"),
            seconds=time.perf_counter() - start,
        )

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        if self.precision == "bf16" and (self.ranks is None or self.ranks.mode == "ddp"):  # FSDP's policy casts
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                return lm_loss(self.model, x, y)
        return lm_loss(self.model, x, y)

    # -- outer step -------------------------------------------------------

    @torch.no_grad()
    def pseudo_gradient(self, into: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Δ = start − θ_local, fp32 on CPU; the start is θ unless rounds overlap. The tensors are
        consecutive views of one vector, which the swarm's round can take as its buffer as it is
        (``average(..., donate=True)``) instead of copying it.

        ``into``: a vector to add Δ into instead (error feedback's residual, ``RoundProtocol.
        delta_target``): the round then sends Δ plus what earlier rounds dropped without a vector
        of Δ alone. Each value is the same sum as adding the residual to Δ afterwards."""
        self.landing.rebase_if_due()
        start, local = self.landing.start(), self._local()
        numel = sum(g.numel() for g in start)
        if into is None:  # a new vector each round (the round takes it): on disk with outer.state_dir
            flat = self.mapped.scratch(numel) if self.mapped is not None else torch.empty(numel, dtype=torch.float32)
        elif into.dtype != torch.float32 or into.dim() != 1 or into.numel() != numel or not into.is_contiguous():
            raise ValueError(f"pseudo-gradient into=: needs a contiguous fp32 vector of {numel} values")
        else:
            flat = into
        delta, at = [], 0
        for g, p in zip(start, local):
            d = flat[at : at + g.numel()].view_as(g)
            if into is None:
                _delta(g, p, out=d)
            else:
                d.add_(_delta(g, p))  # one tensor's Δ at a time
            delta.append(d)
            at += g.numel()
        return delta

    @property
    def origin(self) -> list[torch.Tensor] | None:
        """Where the local copy started this round when that is not θ (overlapped rounds)."""
        return self.landing.origin

    def settle(self) -> None:
        """The round in flight committed (after ``apply_outer``) or will not: stop waiting for it."""
        self.landing.settle()

    def apply_outer(self, avg_delta: list[torch.Tensor], *, reset_local: bool = True) -> None:
        """Outer step on θ with the round's averaged Δ; the local copy restarts from the new
        θ. Unless rounds overlap: the local copy is then training the next round already,
        and at its next step it moves by what θ moved relative to where it started
        (θ_new − origin), keeping the progress it made, and that θ becomes its origin.
        The sooner an average lands, the fewer steps run from the stale start: landing
        before the first step is exactly a round without overlap."""
        with self._lock:
            self.outer_opt.step(avg_delta)
            self.round += 1
            if not reset_local:
                self.landing.due()
        if reset_local:
            self.reset_local()

    def land(self) -> None:
        """A committed average that has not landed in the local copy yet lands now (before a
        checkpoint; on a DDP rank a collective, as every landing is)."""
        self.landing.rebase_if_due()

    @torch.no_grad()
    def reset_local(self) -> None:
        """Discard local progress: θ_local ← θ (AdamW state stays)."""
        self.landing.reset()
        for g, p in zip(self.global_params, self._local()):
            p.copy_(g)
        self._local_written()

    @torch.no_grad()
    def start_overlapped(self, own_delta: list[torch.Tensor] | None = None) -> None:
        """Start the next round's inner steps before this round's average is known.

        delayed: from θ as last committed. eager: from a preview of the coming outer step
        in which this peer's own Δ stands in for the unknown average (the eager updates of
        arXiv 2502.12996). The preview is linear in Δ, so the token-weighted mean of the
        members' previews is exactly the committed θ: each start is off only by the
        member's own deviation from the average (a 1/M share of Δ does worse:
        docs/history.md). The preview is local: θ and the outer momentum change only through
        ``apply_outer``.

        ``own_delta`` None: Δ is computed again here, one tensor at a time (the pseudo-gradient
        went into error feedback's vector, ``pseudo_gradient(into=)``, which holds more than Δ)."""
        if self.outer_cfg.overlap == "delayed":
            start = [g.clone() for g in self.global_params]
        elif own_delta is not None:
            start = self.outer_opt.preview(own_delta)
        else:
            start = [self.outer_opt.preview_tensor(i, _delta(g, p))
                     for i, (g, p) in enumerate(zip(self.landing.start(), self._local()))]
        with self._lock:
            for s, p in zip(start, self._local()):
                p.copy_(s)
            self._local_written()
            self.landing.begin(start)

    # -- swarm state --------------------------------------------------------

    def global_state(self) -> dict:
        """What a joining peer downloads: round, θ and outer momentum (CPU fp32 copies, in an
        unlinked mapped file with ``outer.state_dir``; under the lock, as ``state_dict``)."""
        with self._lock:
            return {
                "round": self.round,
                "params": self._copy(self.global_params),
                "momentum": self._copy([m.detach().to("cpu", torch.float32) for m in self.outer_opt.momentum_buffers()]),
            }

    def with_global_state(self, fn):
        """``fn(round, params, momentum)`` on θ and the momentum themselves, under the lock: a
        snapshot built from them without a copy in between (``global_state`` copies)."""
        with self._lock:
            return fn(self.round, self.global_params, self.outer_opt.momentum_buffers())

    @torch.no_grad()
    def load_global_state(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise ValueError("global state: expected a dict")
        rnd = state.get("round")
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
            raise ValueError("global state: round must be an int >= 0")
        _check_tensors(state.get("params"), self.global_params, "global state params")
        _check_tensors(state.get("momentum"), self.global_params, "global state momentum")
        for g, t in zip(self.global_params, state["params"]):
            g.copy_(t)
        # The momentum exists once any outer step was taken, i.e. from round 1.
        self.outer_opt.load_state_dict({"steps": rnd, "momentum": state["momentum"]})
        self.round = rnd
        self.reset_local()

    def params_hash(self) -> str:
        return params_digest(self.global_params)

    def state_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(g.shape) for g in self.global_params]

    @torch.no_grad()
    def eval_loss(self) -> float:
        """Mean loss of θ (not the local copy) on the held-out batches."""
        if self._eval_batches is None:
            self._eval_batches = self.sampler.eval_batches(self.data_cfg.eval_batches)
        params = self._local()
        saved = [p.detach().clone() for p in params]
        was_training = self.model.training
        for g, p in zip(self.global_params, params):
            p.copy_(g)
        self._local_written()
        self.model.eval()
        try:
            total = sum(self._loss(x, y).float() for x, y in self._eval_batches)
        finally:
            for p, s in zip(params, saved):
                p.copy_(s)
            self._local_written()
            self.model.train(was_training)
        return total.item() / len(self._eval_batches)

    # -- checkpoint -----------------------------------------------------------

    def _config_echo(self) -> dict:
        return {"source": self.model_cfg.source, "seq_len": self.seq_len, "batch_size": self.data_cfg.batch_size}

    def model_info(self) -> dict:
        """What `gonka-node export` needs besides θ: the config, the parameter names, the tokenizer."""
        m = self.loaded
        return {"source": m.source, "config": m.config, "param_names": list(m.param_names),
                "tokenizer_dir": m.tokenizer_dir}

    def state_dict(self) -> dict:
        """Everything needed to resume this worker exactly (loadable with weights_only=True).
        Read under the worker's lock: an overlapped outer step running in another thread (a
        stop can come in the middle of one) is in it entirely or not at all."""
        self.landing.rebase_if_due()
        with self._lock:
            return self._state_dict()

    def _state_dict(self) -> dict:
        state = {
            "config": self._config_echo(),
            "round": self.round,
            "inner_step": self.inner_step,
            "global_params": self._copy(self.global_params),
            "outer": self.outer_opt.state_dict(copy=self._copy),
            "local_params": [p.detach().to("cpu", copy=True) for p in self._local()],
            "inner_opt": self.inner_opt.state_dict() if self.ranks is None else local_optimizer_state(
                self.inner_opt.state_dict()),
            "sampler": self.sampler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "origin": None if self.origin is None else [o.clone() for o in self.origin],
        }
        if self.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """A checkpoint's copy of θ or the momentum: in RAM, or with ``outer.state_dir`` in an
        unlinked mapped file there (trainer/hoststate.py), so a checkpoint needs no RAM for it."""
        return [t.clone() for t in tensors] if self.mapped is None else self.mapped.copy_of(tensors)

    @torch.no_grad()
    def load_state_dict(self, d: dict) -> None:
        if not isinstance(d, dict):
            raise ValueError("checkpoint: expected a dict")
        echo = d.get("config")
        if echo != self._config_echo():
            raise ValueError(f"checkpoint: written for {echo}, this worker is {self._config_echo()}")
        for key in ("round", "inner_step"):
            if not isinstance(d.get(key), int) or d[key] < 0:
                raise ValueError(f"checkpoint: {key} must be an int >= 0")
        _check_tensors(d.get("global_params"), self.global_params, "checkpoint global_params")
        _check_tensors(d.get("local_params"), [p.detach() for p in self._local()], "checkpoint local_params")
        if not isinstance(d.get("rng_cpu"), torch.Tensor) or d["rng_cpu"].dtype != torch.uint8:
            raise ValueError("checkpoint: rng_cpu must be a uint8 tensor")
        if d.get("origin") is not None:
            _check_tensors(d["origin"], self.global_params, "checkpoint origin")
        self.outer_opt.load_state_dict(d.get("outer"))
        self.inner_opt.load_state_dict(d.get("inner_opt"))
        if self.ranks is not None:
            reshard_optimizer_state(self.inner_opt)
        self.sampler.load_state_dict(d.get("sampler"))
        for g, t in zip(self.global_params, d["global_params"]):
            g.copy_(t)
        for p, t in zip(self._local(), d["local_params"]):
            p.copy_(t)
        self._local_written()
        torch.set_rng_state(d["rng_cpu"])
        if "rng_cuda" in d and self.device.type == "cuda":
            torch.cuda.set_rng_state(d["rng_cuda"], self.device)
        # A loaded state has no round in flight.
        self.landing.reset(None if d.get("origin") is None else [o.clone() for o in d["origin"]])
        self.round = d["round"]
        self.inner_step = d["inner_step"]


def params_digest(params) -> str:
    """blake2b of θ's shapes and raw bytes: equal iff θ is bit-identical (the ``params_hash``)."""
    h = hashlib.blake2b(digest_size=16)
    for g in params:
        h.update(repr(tuple(g.shape)).encode())
        h.update(g.contiguous().numpy().tobytes())
    return h.hexdigest()
