"""A checker's measurement of another member's update: the loss it leaves on that member's
assigned data, on the checker's own and on other data (p2p/checks.py decides who checks whom and
what it means).

The update u is what the member sent the round (its pseudo-gradient, as the owners decoded it):
θ − u is, up to the codec, the model the member trained. On the windows it trained on, that
model's loss is lower than on windows it never saw (it learned them). The checker's own update
is the yardstick, on the same windows: each window's difficulty and each update's general
progress cancel in the differences (p2p/checks.py ``judge``).

Cost per check: one load of θ − u into the local copy and forward passes over 3 sets of
``CHECK_WINDOWS`` windows, plus, once per round whatever the number of checks, θ and the
checker's own update on the windows every check shares; between a round's commit and its outer
step, when the local copy is about to be reset to the new θ anyway.
"""

from __future__ import annotations

import torch

Batches = list[tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def mean_losses(worker, evaluations: list[tuple[torch.Tensor | None, list[Batches]]]) -> list[list[float]]:
    """For each (u, groups): the mean loss of θ − u (θ itself for None) over each group of
    batches, θ the worker's global parameters (the state the updates came from: called between a
    commit and its outer step) and u a flat fp32 vector laid out as θ's tensors. The local copy is
    overwritten (it holds θ when this returns; the outer step resets it anyway)."""
    theta, local = worker.global_params, worker._local()
    model = worker.model
    was_training = model.training
    model.eval()
    try:
        out = []
        for u, groups in evaluations:
            offset = 0
            for t, g in zip(local, theta):
                n = g.numel()
                t.copy_(g if u is None else g - u[offset : offset + n].view_as(g).to(g.device))
                offset += n
            assert u is None or offset == u.numel(), "an update shaped like θ"
            out.append([sum(float(worker._loss(x, y)) for x, y in group) / max(len(group), 1) for group in groups])
        return out
    finally:
        for t, g in zip(local, theta):
            t.copy_(g)
        model.train(was_training)


def yardstick(worker, own: torch.Tensor, own_windows: Batches, control: Batches,
              members: dict[str, Batches]) -> dict:
    """What every check of a round compares with, measured once: the checker's own update's
    loss on its windows, on the control windows and on each sampled member's windows, and θ's
    loss on the control windows."""
    ours, base = mean_losses(worker, [(own, [own_windows, control, *members.values()]), (None, [control])])
    return {"own": ours[0], "control": ours[1], "base": base[0], "members": dict(zip(members, ours[2:]))}


def check_gains(worker, sampled: str, update: torch.Tensor, windows: Batches, own_windows: Batches,
                control: Batches, shared: dict) -> tuple[float, ...]:
    """The losses p2p/checks.py ``judge`` weighs: ``update``'s on the member's ``windows``, the
    checker's and the control windows, then the checker's update's on the same three (from
    ``shared``, the round's ``yardstick``), then θ's on the control windows."""
    (mine,) = mean_losses(worker, [(update, [windows, own_windows, control])])
    return (*mine, shared["members"][sampled], shared["own"], shared["control"], shared["base"])


def trained_windows(sampler, peer: str, round: int, tokens: float, seq_len: int, count: int) -> Batches:
    """The batches of the last ``count`` windows ``peer`` trained in ``round`` by its claim of
    ``tokens`` (its stream, trainer/data.py: T tokens are the first T / seq_len windows)."""
    n = int(tokens // seq_len)
    return sampler.stream_batches(peer, round, range(max(0, n - count), n))


def control_windows(sampler, beacon: bytes, round: int, count: int) -> Batches:
    """``count`` training windows the round's beacon chose: a stream no peer trains on."""
    return sampler.stream_batches(f"control/{beacon.hex()}", round, range(count))
