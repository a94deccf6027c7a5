"""A checker's measurement of another member's update: the loss it removes on that member's
assigned data and on other data (p2p/checks.py decides who checks whom and what it means).

The update u is what the member sent the round (its pseudo-gradient, as the owners decoded it):
θ − u is, up to the codec, the model the member trained. On the windows it trained on, that
model's loss is lower than on windows it never saw (it learned them); on any data it is lower
than θ's if it learned anything. Both are measured against the checker's own update on its own
windows and on the same other windows: the reference a member of the same round earns.

Cost per check: one load of θ − u into the local copy per update and the forward passes over the
windows (``CHECK_WINDOWS`` of each kind, 3 models), between a round's commit and its outer step,
when the local copy is about to be reset to the new θ anyway.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def update_gains(worker, updates: list[torch.Tensor], batches: list[list[tuple[torch.Tensor, torch.Tensor]]]
                 ) -> list[list[float]]:
    """gains[u][b]: the mean loss over ``batches[b]`` at θ minus at θ − ``updates[u]`` (flat fp32
    vectors laid out as θ's tensors), θ the worker's global parameters (the state the updates came
    from: called between a commit and its outer step). The local copy is overwritten (it holds θ
    when this returns; the outer step resets it anyway)."""
    theta, local = worker.global_params, worker._local()
    model = worker.model
    was_training = model.training
    model.eval()

    def mean_losses() -> list[float]:
        return [sum(float(worker._loss(x, y)) for x, y in group) / max(len(group), 1) for group in batches]

    try:
        for t, g in zip(local, theta):
            t.copy_(g)
        base = mean_losses()
        out = []
        for u in updates:
            offset = 0
            for t, g in zip(local, theta):
                n = g.numel()
                t.copy_(g - u[offset : offset + n].view_as(g).to(g.device))
                offset += n
            assert offset == u.numel(), "an update shaped like θ"
            out.append([b - a for b, a in zip(base, mean_losses())])
        return out
    finally:
        for t, g in zip(local, theta):
            t.copy_(g)
        model.train(was_training)
