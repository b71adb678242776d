"""Tests written for mutants that survived the unit suite (``python -m tests.support.mutate``):
each names the mutated line it now catches."""
from __future__ import annotations

import pytest
import torch

from megatron_pg_agg.core.aggregation import TokenWeights, token_weights
from megatron_pg_agg.core.losses import PGLossConfig, SequenceStatistic, vocab_parallel_logprobs
from megatron_pg_agg.data.planner import PlanConfig, padded_lengths, plan_step, rollout_correction
from megatron_pg_agg.data.rollouts import PlanError, Rollout, RolloutBatch
from tests.support.rollouts import fixed_step


def test_token_weights_of_different_modes_do_not_concatenate():
    """aggregation.py ``TokenWeights.cat``: ``len(modes) != 1`` -> ``==`` refused every cat."""
    n = torch.tensor([True, True, False])
    cu = torch.tensor([0, 3])
    a = token_weights(n, mode="token_mean", cu_seqlens=cu)
    b = token_weights(n, mode="seq_mean", cu_seqlens=cu)
    assert torch.equal(TokenWeights.cat([a, a]).coef, torch.cat([a.coef, a.coef]))
    with pytest.raises(ValueError, match="different modes"):
        TokenWeights.cat([a, b])


def test_log_probs_of_huge_logits_are_finite_and_exact():
    """losses.py ``vocab_parallel_logprobs``: the stabilising shift is the row max (a row min
    overflows exp() for logits spread by ~100 or more and gives inf / NaN)."""
    logits = torch.tensor([[500.0, 0.0, -200.0, 499.0]])
    target = torch.tensor([3])
    logp, entropy = vocab_parallel_logprobs(logits, target, with_entropy=True)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert float(logp) == pytest.approx(float(ref[0, 3]), abs=1e-5)
    assert float(entropy) == pytest.approx(float(-(ref.exp() * ref).sum()), abs=1e-5)


def test_the_sequence_statistic_maps_trailing_padding_to_the_last_sequence():
    """losses.py ``SequenceStatistic``: positions past the last boundary (a microbatch padded to a
    fixed length) belong to the last sequence: ``clamp_(max=numel - 1)`` -> ``+ 1`` indexed past
    the per-sequence sums."""
    cu = torch.tensor([0, 2, 5])
    stat = SequenceStatistic(cu, torch.tensor([2.0, 3.0]), total=8)
    values = torch.arange(8, dtype=torch.float32)
    mask = torch.tensor([True, True, True, True, True, False, False, False])
    mean = stat.mean(values, mask)
    assert mean.tolist() == [0.5, 0.5, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]


def test_the_first_rollout_over_capacity_is_named_not_one_exactly_at_it():
    """planner.py ``padded_lengths``: the rollout named is the first with ``padded > cap``; with
    ``>=`` an earlier rollout exactly at the capacity would be named instead."""
    rollouts = fixed_step()
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rollouts]
    cap = max(lengths) - 1
    over = min(i for i in range(len(rollouts)) if lengths[i] > cap)  # the first one over
    assert over > 0
    at_cap = next((i for i in range(over) if lengths[i] == cap), None)
    if at_cap is None:  # make one: an earlier rollout exactly at the capacity
        r = rollouts[0]
        extra = cap - lengths[0]
        rollouts[0] = Rollout(prompt_ids=list(r.prompt_ids) + [1] * extra, response_ids=r.response_ids,
                              loss_mask=r.loss_mask, advantages=r.advantages, old_logprobs=r.old_logprobs,
                              ref_logprobs=r.ref_logprobs, numerator_mask=r.numerator_mask, group_id=r.group_id)
    with pytest.raises(PlanError, match=rf"^rollout {over} "):
        padded_lengths(RolloutBatch.from_rollouts(rollouts), PlanConfig(max_tokens_per_microbatch=cap))


@pytest.mark.parametrize("kind", ["sequence_truncate", "sequence_mask"])
def test_a_sequence_with_one_valid_token_gets_its_own_sequence_ratio(kind):
    """core/rollout_correction.py ``rollout_correction`` (through the planner's call): a sequence's
    mean delta needs ``counts > 0``; with ``counts > 1`` a one-valid-token sequence got delta 0
    (ratio 1: never truncated or masked)."""
    base = dict(prompt_ids=[1, 2], advantages=[0.5, 0.5], group_id=0)
    one = Rollout(response_ids=[3, 4], loss_mask=[1, 0], old_logprobs=[-1.0, -1.0],
                  rollout_logprobs=[-2.0, -1.0], **base)  # exp(1) = 2.72 > C = 2: truncated / masked
    two = Rollout(response_ids=[3, 4], loss_mask=[1, 1], old_logprobs=[-1.0, -1.0],
                  rollout_logprobs=[-1.0, -1.0], **base)
    cfg = PGLossConfig(rollout_correction=kind, rollout_correction_max=2.0, rollout_correction_min=0.5)
    corr = rollout_correction(RolloutBatch.from_rollouts([one, two]), cfg)
    if kind == "sequence_truncate":
        assert corr.weights[0] == pytest.approx(2.0) and bool(corr.truncated[0])
        assert corr.weights[2] == pytest.approx(1.0) and not bool(corr.truncated[2])
    else:
        assert bool(corr.masked[0]) and not bool(corr.numerator_mask[0]) and bool(corr.numerator_mask[2])


def test_a_token_capacity_that_holds_the_whole_step_plans_one_microbatch_per_rank():
    """planner.py ``_choose_microbatches``: the count starts at ``max(1, ceil(tokens / (dp *
    cap)))``; with a floor of 2 a step that fits one microbatch per rank got two."""
    batch = RolloutBatch.from_rollouts(fixed_step())
    total = int((batch.prompt_lengths + batch.response_lengths).sum())
    plan = plan_step(batch, PGLossConfig(), PlanConfig(dp_size=2, max_tokens_per_microbatch=total))
    assert plan.stats["microbatches_per_rank"] == 1 and len(plan.microbatches[0]) == 1
    plan = plan_step(batch, PGLossConfig(), PlanConfig(dp_size=1, max_tokens_per_microbatch=total // 2 + 40))
    assert plan.stats["microbatches_per_rank"] >= 2


def test_balance_statistics_are_max_over_mean():
    """planner.py stats: ``microbatch_balance`` and ``rank_balance`` are max / mean of the padded
    tokens (a ``min`` there reported balance < 1)."""
    plan = plan_step(fixed_step(), PGLossConfig(), PlanConfig(dp_size=2, num_microbatches=3))
    flat = [t for row in plan.bin_tokens for t in row]
    per_rank = [sum(row) for row in plan.bin_tokens]
    assert plan.stats["microbatch_balance"] == pytest.approx(max(flat) / (sum(flat) / len(flat)))
    assert plan.stats["rank_balance"] == pytest.approx(max(per_rank) / (sum(per_rank) / len(per_rank)))
    assert plan.stats["microbatch_balance"] >= 1 and plan.stats["rank_balance"] >= 1


def test_the_planners_host_records_are_immutable():
    """The planner trusts what it built (no re-checks downstream), so its configs and phase
    results cannot be changed after the fact: ``frozen=True`` dropped from any of them fails."""
    import dataclasses

    from megatron_pg_agg.data import planner

    batch = RolloutBatch.from_rollouts(fixed_step())
    plan_cfg = PlanConfig(dp_size=2, num_microbatches=2)
    order = planner.canonical_order(batch, plan_cfg)
    cfg = PGLossConfig(rollout_correction="token_truncate")
    rollouts = fixed_step()
    for r in rollouts:  # a correction needs the rollout engine's log-probs
        r.rollout_logprobs = list(r.old_logprobs)
    corrected = RolloutBatch.from_rollouts(rollouts)
    records = {
        "PlanConfig": plan_cfg,
        "CanonicalOrder": order,
        "StepWeights": planner.step_weights(batch, order, PGLossConfig()),
        "Bins": planner.pack_bins(order, plan_cfg),
        "RolloutCorrection": rollout_correction(corrected, cfg),
    }
    for name, record in records.items():
        field = dataclasses.fields(record)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, field, None)
        assert name == type(record).__name__
