"""What must not change a plan: the values and order of prompt-group labels. What must hold at
the microbatch capacity: exactly full is accepted, one token over is refused."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.planner import PlanConfig, padded_lengths, plan_step
from megatron_pg_agg.data.rollouts import PlanError, RolloutBatch
from tests.support.rollouts import fixed_step


def _same_plan(a, b) -> None:
    assert a.totals == b.totals and a.group_sizes == b.group_sizes and a.bin_tokens == b.bin_tokens
    for row_a, row_b in zip(a.microbatches, b.microbatches):
        for ma, mb in zip(row_a, row_b):
            assert ma.sequence_ids == mb.sequence_ids
            for name in ("tokens", "numerator_mask", "denominator_mask", "advantages", "cu_seqlens_padded",
                         "seq_numerator_tokens"):
                assert torch.equal(getattr(ma, name), getattr(mb, name)), name
            assert torch.equal(ma.token_weights.coef, mb.token_weights.coef)
            assert torch.equal(ma.token_weights.count, mb.token_weights.count)


@pytest.mark.parametrize("mode", ["prompt_mean", "seq_mean", "token_mean", "constant"])
def test_group_labels_of_any_value_and_order_give_the_same_plan(mode):
    """group_index relabelled by a bijection (negative, large, decreasing integers): the plan, W
    and every microbatch are the same. Would catch grouping or ordering by label value (a sort
    of the labels, a bincount that assumes labels 0..G-1) instead of by first appearance."""
    batch = RolloutBatch.from_rollouts(fixed_step())
    cfg = PGLossConfig(mode=mode, divisor=16.0 if mode == "constant" else None, kl_coef=0.1)
    plan_cfg = PlanConfig(dp_size=2, num_microbatches=3)
    base = plan_step(batch, cfg, plan_cfg)
    groups = int(batch.group_index.max()) + 1
    for mapping in (lambda g: 10**9 - 7 * g, lambda g: -3 - g, lambda g: (g * 5 + 3) % (5 * groups)):
        relabelled = replace(batch, group_index=torch.tensor([mapping(int(g)) for g in batch.group_index]),
                             group_labels=None)
        _same_plan(base, plan_step(relabelled, cfg, plan_cfg))
    assert base.totals.pg_weight > 0


def test_rollout_objects_with_other_group_ids_give_the_same_plan():
    """The Rollout path: string ids, integer ids and tuples naming the same groups plan alike."""
    rollouts = fixed_step()
    names = {g: k for k, g in enumerate(dict.fromkeys(r.group_id for r in rollouts))}
    cfg, plan_cfg = PGLossConfig(mode="prompt_mean"), PlanConfig(dp_size=2, num_microbatches=2)
    base = plan_step(rollouts, cfg, plan_cfg)
    for relabel in (lambda g: 1000 - names[g], lambda g: ("prompt", names[g]), lambda g: f"z{-names[g]}"):
        _same_plan(base, plan_step([replace(r, group_id=relabel(r.group_id)) for r in rollouts], cfg, plan_cfg))


def test_a_sequence_exactly_at_capacity_fits_and_one_token_more_is_refused():
    """Capacity = the longest padded sequence: accepted. One token less capacity: a PlanError
    naming that rollout. Would catch ``>=`` for ``>`` in the capacity check (or an off-by-one in
    the padded length)."""
    batch = RolloutBatch.from_rollouts(fixed_step())
    lengths = batch.prompt_lengths + batch.response_lengths
    longest = int(lengths.max())
    padded_lengths(batch, PlanConfig(max_tokens_per_microbatch=longest))  # exactly at capacity
    with pytest.raises(PlanError, match=rf"rollout {int(lengths.argmax())} .*do not fit a microbatch of {longest - 1}"):
        padded_lengths(batch, PlanConfig(max_tokens_per_microbatch=longest - 1))


def test_a_bin_exactly_full_is_planned_and_one_token_over_is_refused():
    """One microbatch on one rank holding the whole step: capacity = the step's padded tokens is
    accepted (the bin is exactly full), one token less is refused naming the bin."""
    batch = RolloutBatch.from_rollouts(fixed_step())
    total = int((batch.prompt_lengths + batch.response_lengths).sum())
    cfg = PGLossConfig()
    plan = plan_step(batch, cfg, PlanConfig(num_microbatches=1, max_tokens_per_microbatch=total))
    assert plan.bin_tokens == [[total]]
    with pytest.raises(PlanError, match=rf"microbatch 0 of DP rank 0\s+would hold {total}"):
        plan_step(batch, cfg, PlanConfig(num_microbatches=1, max_tokens_per_microbatch=total - 1))
