"""``with_current_logprobs``: the recomputed old log-probs land exactly where the loss reads them.

(``planned_logprobs`` itself runs megatron-core's schedule: tests/distributed/test_grpo_reach.py
compares it with the sampler's log-probs token by token.)"""
from __future__ import annotations

import torch

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.data.rollouts import Rollout, RolloutBatch
from megatron_pg_agg.megatron.logprob_pass import with_current_logprobs


def _plan():
    rollouts = [Rollout(prompt_ids=[1, 2, 3][: 1 + i % 3], response_ids=list(range(4, 4 + 2 + i)),
                        loss_mask=[1 if (i + j) % 4 else 0 for j in range(2 + i)], advantages=[0.5] * (2 + i),
                        old_logprobs=[-1.0] * (2 + i), group_id=i // 2) for i in range(6)]
    batch = RolloutBatch.from_rollouts(rollouts, vocab_size=16)
    return plan_step(batch, PGLossConfig(mode="seq_mean"), PlanConfig(dp_size=2, max_tokens_per_microbatch=12))


def test_old_logprobs_replaced_at_scored_positions_only():
    plan = _plan()
    for rank in range(2):
        mine = plan.for_rank(rank)
        fresh = [-torch.rand(mb.num_tokens) for mb in mine]
        out = with_current_logprobs(mine, fresh)
        assert len(out) == len(mine) > 0
        for mb, new, lp in zip(mine, out, fresh):
            mask = mb.denominator_mask
            assert bool(mask.any()) and not bool(mask.all())
            assert torch.equal(new.old_logprobs[mask], lp[mask])
            assert torch.equal(new.old_logprobs[~mask], torch.zeros(int((~mask).sum())))
            # everything else is the same microbatch
            assert new.tokens is mb.tokens and new.advantages is mb.advantages and new.token_weights is mb.token_weights
            assert torch.equal(mb.old_logprobs[mask], torch.full((int(mask.sum()),), -1.0))  # the input is untouched
