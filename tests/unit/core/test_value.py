"""The value term: PPO's (clipped) value loss per token, aggregated under the policy term's contract."""
from __future__ import annotations

import random

import pytest
import torch

from megatron_pg_agg.core.aggregation import token_weights
from megatron_pg_agg.core.value import ValueLossConfig, value_loss_sum, value_token_losses
from tests.support.reference import MODE_KWARGS, random_step, reference_objective


def test_the_per_token_loss_by_hand():
    """V_old = 1, eps = 0.2, R = 2: V = 1.5 clamps to 1.2 and max((1.5-2)^2, (1.2-2)^2) = 0.64
    (the clipped branch); V = 2.4 clamps to 1.2 too, max(0.16, 0.64) = 0.64; V = 1.1 lies inside the
    clip (0.81 both, not counted as clipped). Factor 0.5 (AReaL, verl, NeMo-RL) and 1 (slime);
    unclipped: h (V - R)^2. Catches the clamp around R or V instead of V_old, min for max, or the
    factor applied twice."""
    values, old, ret = torch.tensor([1.5, 2.4, 1.1]), torch.ones(3), torch.full((3,), 2.0)
    half, clipped = value_token_losses(values, old, ret, ValueLossConfig(clip_eps=0.2))
    assert half.tolist() == pytest.approx([0.5 * 0.64, 0.5 * 0.64, 0.5 * 0.81])
    assert clipped.tolist() == [True, True, False]
    whole, _ = value_token_losses(values, old, ret, ValueLossConfig(clip_eps=0.2, factor=1.0))
    assert whole.tolist() == pytest.approx([0.64, 0.64, 0.81])
    plain, none = value_token_losses(values, old, ret, ValueLossConfig())
    assert plain.tolist() == pytest.approx([0.5 * 0.25, 0.5 * 0.16, 0.5 * 0.81]) and not none.any()


def test_the_gradient_follows_the_larger_branch():
    """Where the clipped branch wins the loss is flat in V (its V is clamped): zero gradient; inside
    the clip it is h 2 (V - R)."""
    values = torch.tensor([1.5, 1.1], requires_grad=True)
    loss, _ = value_token_losses(values, torch.ones(2), torch.full((2,), 2.0), ValueLossConfig(clip_eps=0.2))
    loss.sum().backward()
    assert values.grad.tolist() == pytest.approx([0.0, 0.5 * 2 * (1.1 - 2.0)])


def test_settings_refused_by_name_and_the_policys_mode_by_default():
    with pytest.raises(ValueError, match="Huber"):
        ValueLossConfig(loss="huber")
    with pytest.raises(ValueError, match="divisor goes with a value mode"):
        ValueLossConfig(divisor=4.0)
    with pytest.raises(ValueError, match="clip_eps must be positive"):
        ValueLossConfig(clip_eps=0.0)
    with pytest.raises(ValueError, match="needs divisor"):
        ValueLossConfig(mode="constant")
    assert ValueLossConfig().with_policy_mode("constant", 8.0) == ValueLossConfig("constant", 8.0)
    assert ValueLossConfig("seq_mean").with_policy_mode("token_mean").mode == "seq_mean"
    assert ValueLossConfig("seq-mean-token-mean").mode == "seq_mean"


@pytest.mark.parametrize("mode", list(MODE_KWARGS))
def test_any_partition_gives_the_reference_objective(mode):
    """Ragged steps with filtered numerator tokens and poisoned masked positions: summing
    (value_loss_sum, count) over a random cut of the tokens into parts gives the slow float64
    reference of the mode on the per-token losses (J and its gradient in V). Catches the value
    weights built from another mode, masked positions reaching the sum, or a per-part count."""
    rng = random.Random(5)
    for _ in range(20):
        step = random_step(rng)
        total = step.loss.numel()
        if total == 0:
            continue
        kwargs = dict(MODE_KWARGS[mode], **({"group_sizes": step.group_sizes} if mode == "prompt_mean" else {}))
        weights = token_weights(step.numerator, mode=mode, cu_seqlens=step.cu_seqlens,
                                denominator_mask=step.denominator, **kwargs)
        values = torch.randn(total, dtype=torch.float64).requires_grad_(True)
        old, ret = torch.randn(total), torch.randn(total)
        cfg = ValueLossConfig(mode, kwargs.get("divisor"), clip_eps=0.3)
        cuts = sorted({0, total, *(rng.randrange(total + 1) for _ in range(3))})
        parts = [value_loss_sum(values[a:b], old[a:b], ret[a:b], step.numerator[a:b], weights[a:b], cfg)
                 for a, b in zip(cuts[:-1], cuts[1:])]
        loss = sum(p[0] for p in parts)
        count = int(sum(int(p[1]) for p in parts))
        got = loss / count if count else loss
        per_token, _ = value_token_losses(values, old, ret, cfg)
        want, weight = reference_objective(per_token, step.numerator, step.denominator, step.lengths,
                                           step.group_sizes, mode, kwargs.get("divisor"))
        assert count == weight
        assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-7)
        if weight and want.requires_grad:
            (g,) = torch.autograd.grad(got, values, retain_graph=True)
            (r,) = torch.autograd.grad(want, values)
            assert torch.allclose(g, r, rtol=1e-5, atol=1e-7)
