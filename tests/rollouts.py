"""A fixed ragged rollout step shared by the planner tests and the multi-process parity suite.

Ragged prompt groups (sizes 3, 1, 2, 4, 2), a response with no valid token, filtered numerator
tokens, sequence lengths from 3 to 21 tokens: microbatches and DP ranks get different token
counts, so per-token scaling is really exercised.
"""
import random

from megatron_pg_agg.planner import Rollout

VOCAB = 64


def fixed_step(seed: int = 7, with_ref: bool = True) -> list:
    rng = random.Random(seed)
    rollouts = []
    group_sizes = [3, 1, 2, 4, 2]
    seq = 0
    for g, size in enumerate(group_sizes):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        for _ in range(size):
            resp_len = rng.randint(1, 15)
            mask = [1 if rng.random() > 0.15 else 0 for _ in range(resp_len)]
            if seq == 4:
                mask = [0] * resp_len  # a response with no valid token
            numerator = [m if rng.random() > 0.2 else 0 for m in mask]  # filtered tokens
            adv = rng.uniform(-1.5, 1.5)
            rollouts.append(Rollout(
                prompt_ids=prompt,
                response_ids=[rng.randrange(VOCAB) for _ in range(resp_len)],
                loss_mask=mask,
                advantages=[adv + rng.uniform(-0.1, 0.1) for _ in range(resp_len)],
                old_logprobs=[-rng.uniform(2.0, 6.0) for _ in range(resp_len)],
                ref_logprobs=[-rng.uniform(2.0, 6.0) for _ in range(resp_len)] if with_ref else None,
                group_id=f"prompt-{g}",
                numerator_mask=numerator,
            ))
            seq += 1
    # interleave groups in the input order: the planner must regroup them
    rng.shuffle(rollouts)
    return rollouts
