"""The fixed ragged rollout step shared by the planner tests and the parity suite.

Ragged prompt groups (sizes 3, 1, 2, 4, 2), a response with no valid token, filtered numerator
tokens, sequence lengths from 3 to 21 tokens: microbatches and DP ranks get different token
counts, so per-token scaling is really exercised. One generator serves both (parity_rollouts).
"""
from megatron_pg_agg.parity import VOCAB, parity_rollouts


def fixed_step(seed: int = 7, with_ref: bool = True) -> list:
    return parity_rollouts(seed, with_ref=with_ref)


def with_engine_logprobs(steps: dict) -> dict:
    """``steps`` ({step: [Rollout]}) given a rollout engine's log-probs, in place: they differ
    from old_logprobs by up to ~0.06 per token, with a bias per sequence, so both the token and
    the sequence corrections act on them."""
    for rollouts in steps.values():
        for i, r in enumerate(rollouts):
            bias = 0.02 * ((i % 5) - 2)
            r.rollout_logprobs = [lp - bias - 0.02 * ((i + j) % 3 - 1) for j, lp in enumerate(r.old_logprobs)]
    return steps


__all__ = ["VOCAB", "fixed_step", "with_engine_logprobs"]
