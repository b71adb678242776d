"""The fixed ragged rollout step shared by the planner tests and the parity suite.

Ragged prompt groups (sizes 3, 1, 2, 4, 2), a response with no valid token, filtered numerator
tokens, sequence lengths from 3 to 21 tokens: microbatches and DP ranks get different token
counts, so per-token scaling is really exercised. One generator serves both (parity_rollouts).
"""
from megatron_pg_agg.parity import VOCAB, parity_rollouts


def fixed_step(seed: int = 7, with_ref: bool = True) -> list:
    return parity_rollouts(seed, with_ref=with_ref)


__all__ = ["VOCAB", "fixed_step"]
