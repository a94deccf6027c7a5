"""Reference training runs DiLoCo is measured against, in one process.

``DataParallel`` is synchronous data-parallel training (what DDP does): k
workers each take a batch from their own shard, their gradients are averaged
every step, and one AdamW step is applied to the single shared model. Same
model, data shards, optimizer and schedule as the DiLoCo workers, so a
comparison at equal tokens isolates the effect of syncing every H steps.
"""

from __future__ import annotations

import torch

from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.data import ShardSampler
from trainer.diloco import DiLoCoWorker
from trainer.memory import set_lr
from trainer.memory import step as optimizer_step
from trainer.model import lm_loss
from trainer.schedule import inner_lr


class DataParallel:
    def __init__(self, k: int, *, model: ModelConfig, data: DataConfig, inner: InnerConfig, corpus: torch.Tensor,
                 seed: int) -> None:
        # Worker 0 holds the model, optimizer and eval data; the others only their shards,
        # keyed like the simulator's workers ("sim-i"): the same split, sampled alike, though as
        # one stream (round 0: trainer/data.py) where the simulator's are drawn round by round.
        self.holder = DiLoCoWorker(model=model, data=data, inner=inner, outer=OuterConfig(), corpus=corpus,
                                   shard_key="sim-0", seed=seed)
        self.samplers = [self.holder.sampler] + [
            ShardSampler(corpus, shard_key=f"sim-{i}", seed=seed, batch_size=data.batch_size,
                         seq_len=self.holder.seq_len, eval_fraction=data.eval_fraction)
            for i in range(1, k)
        ]
        self.inner = inner
        self.step = 0

    @property
    def tokens_per_step(self) -> int:
        return len(self.samplers) * self.samplers[0].batch_size * self.samplers[0].seq_len

    def train(self, steps: int) -> float:
        """``steps`` synchronous steps; returns the mean training loss."""
        model, opt = self.holder.model, self.holder.inner_opt
        model.train()
        total = 0.0
        for _ in range(steps):
            set_lr(opt, inner_lr(self.step, self.inner))
            opt.zero_grad(set_to_none=True)
            for sampler in self.samplers:  # gradient of the mean loss = mean of the gradients
                x, y = sampler.next_batch()
                loss = lm_loss(model, x, y)
                (loss / len(self.samplers)).backward()
                total += loss.item() / len(self.samplers)
            if self.inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.inner.grad_clip, foreach=False)
            optimizer_step(opt)
            self.step += 1
        return total / max(steps, 1)

    @torch.no_grad()
    def eval_loss(self) -> float:
        for g, p in zip(self.holder.global_params, self.holder.model.parameters()):
            g.copy_(p)
        return self.holder.eval_loss()
