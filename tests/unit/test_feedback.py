"""Error feedback (p2p/feedback.py): what a codec drops of a member's input is kept and sent
in later rounds, so the sum of what was transmitted stays on track; and how its residual lives
in a round's vector."""

import pytest
import torch

from p2p.codec import CodecError
from p2p.codecs import get_codec
from p2p.feedback import ErrorFeedback
from tests.unit.test_codecs import BLOCK, gaussian

pytestmark = pytest.mark.timeout(60)

def cumulative_drift(name: str, signal: torch.Tensor, rounds: int, feedback: bool) -> list[float]:
    """Max |sum of what was transmitted - sum of the true signal| after each round."""
    codec, ef = get_codec(name), ErrorFeedback(signal.numel())
    sent = torch.zeros_like(signal, dtype=torch.float64)
    drift = []
    for r in range(1, rounds + 1):
        payload = ef.encode(codec, signal) if feedback else codec.encode(signal)
        sent += codec.decode(payload, signal.numel()).double()
        drift.append((sent - r * signal.double()).abs().max().item())
    return drift


@pytest.mark.parametrize("name", ("int4", "fp4", "int8"))
def test_error_feedback_keeps_cumulative_sum_on_track(name):
    # One large value per block and many small ones: 4-bit codecs round the
    # small ones to 0 every round, so without feedback they are never sent.
    signal = torch.full((4 * BLOCK + 10,), 1e-3)
    signal[::BLOCK] = 1.0
    signal[1::3] *= -1
    rounds = 200
    with_feedback = cumulative_drift(name, signal, rounds, feedback=True)
    # The drift is minus the residual, so in every round it stays within one
    # rounding error of the compensated vector (block absmax ~1): half a grid
    # step for int8/int4, and for fp4 the gap below its smallest level 2^-6.
    bound = {"int8": 0.5 / 127, "int4": 0.5 / 7, "fp4": 2.0**-7}[name] * 1.01
    assert max(with_feedback) <= bound
    if name != "int8":
        without = cumulative_drift(name, signal, rounds, feedback=False)
        assert without[-1] == pytest.approx(rounds * 1e-3, rel=1e-3)  # grows linearly
        assert without[-1] > 2 * bound


def test_error_feedback_steps_and_state_dict():
    codec, x = get_codec("int4"), gaussian(700)
    ef = ErrorFeedback(700)
    assert torch.equal(ef.compensate(x), x)
    payload = ef.encode(codec, x)
    assert payload == codec.encode(x)
    assert torch.equal(ef.residual, x - codec.decode(payload, 700))
    manual = ErrorFeedback(700)
    manual.load_state_dict(ef.state_dict())
    compensated = manual.compensate(x)
    manual.update(compensated, codec.decode(codec.encode(compensated), 700))
    ef.encode(codec, x)
    assert torch.equal(manual.residual, ef.residual)

    state = ef.state_dict()
    state["residual"].add_(1.0)  # a copy: the live residual is untouched
    assert not torch.equal(state["residual"], ef.residual)
    restored = ErrorFeedback(700)
    restored.load_state_dict(ef.state_dict())
    assert torch.equal(restored.residual, ef.residual)
    ef.reset()
    assert torch.equal(ef.residual, torch.zeros(700))

    for bad in ({"residual": torch.zeros(699)}, {}, {"residual": [0.0] * 700},
                {"residual": torch.full((700,), float("nan"))}, {"residual": torch.zeros(700, dtype=torch.int64)}):
        with pytest.raises(ValueError):
            restored.load_state_dict(bad)
    with pytest.raises(ValueError):
        restored.compensate(torch.zeros(5))


def test_error_feedback_adopts_a_residual_computed_elsewhere():
    ef = ErrorFeedback(5)
    ef.residual.copy_(torch.arange(5.0))
    new = torch.full((5,), 0.25)
    old = ef.adopt(new)
    assert ef.residual is new and torch.equal(old, torch.arange(5.0))
    for bad in (torch.zeros(4), torch.zeros(5, dtype=torch.float64)):
        with pytest.raises(ValueError, match="error feedback holds 5"):
            ef.adopt(bad)
    assert ef.residual is new


def test_error_feedback_keeps_residual_when_encode_refuses():
    ef, x = ErrorFeedback(3), torch.tensor([1.0, 0.01, float("nan")])
    with pytest.raises(CodecError):
        ef.encode(get_codec("fp4"), x)
    assert torch.equal(ef.residual, torch.zeros(3))


def test_error_feedback_folds_into_a_rounds_vector_and_drops_a_round_that_never_settled():
    ef = ErrorFeedback(5)
    ef.residual.copy_(torch.arange(5.0))
    first = torch.ones(5)
    ef.fold(first)  # the residual added in; the vector is the residual's from now on
    assert ef.residual is first and torch.equal(first, torch.arange(5.0) + 1) and ef.holding
    assert ef.state_dict() is None  # a pseudo-gradient is in it: a checkpoint keeps no residual
    assert ef.target is None
    with pytest.raises(ValueError, match="a round's already"):
        ef.fold(first)  # the same vector again, while its round holds it
    with pytest.raises(ValueError):
        ef.fold(torch.ones(4))
    first.copy_(torch.full((5,), 0.25))  # as the round writes the next residual over it
    ef.settle()
    assert not ef.holding and torch.equal(ef.state_dict()["residual"], first)
    # The next pseudo-gradient is added into the residual's vector itself: nothing more to add.
    assert ef.target is first
    first.add_(1.0)
    ef.fold(first)
    assert torch.equal(first, torch.full((5,), 1.25)) and ef.holding
    first.copy_(torch.full((5,), 0.5))
    ef.settle()
    second = torch.ones(5)
    ef.fold(second)  # a vector of its own: the residual is added into it
    assert torch.equal(second, torch.full((5,), 1.5))
    # That round never commits (the swarm moved past it): its vector holds a pseudo-gradient, which
    # the next round must not send again.
    third = torch.full((5,), 2.0)
    ef.fold(third)
    assert torch.equal(third, torch.full((5,), 2.0)) and ef.residual is third and ef.restarts == 1
