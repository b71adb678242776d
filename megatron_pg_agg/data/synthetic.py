"""The built-in synthetic rollout set: what the trainer replays with ``--rollouts synthetic``
(``launch/train_actor.py``; without ``--rollouts`` it trains online instead), and what the
Megatron-LM entries train on when no ``--pg-rollouts`` file is given. Four fixed steps, replayed
in turn: a fixture for the tests (exact objectives, layouts, checkpoints), not a task to learn."""
from __future__ import annotations

import math
import random

from .rollouts import Rollout


def synthetic_rollouts(*, num_steps: int = 4, prompts_per_step: int = 6, group_size: int = 4,
                       vocab_size: int = 128, seed: int = 0) -> dict:
    """A deterministic GRPO-like rollout set: per step, prompts with ``group_size`` responses of
    ragged length; reward = share of even token ids in the response, advantages = reward minus the
    group mean (so the actor learns to favour even tokens); old log-probs near uniform; reference
    log-probs for a KL term; some tokens masked out and some filtered from the numerator."""
    rng = random.Random(seed)
    uniform = -math.log(vocab_size)
    steps = {}
    for step in range(num_steps):
        rollouts = []
        for p in range(prompts_per_step):
            prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(3, 10))]
            responses = [[rng.randrange(vocab_size) for _ in range(rng.randint(4, 28))] for _ in range(group_size)]
            rewards = [sum(1 for t in r if t % 2 == 0) / len(r) for r in responses]
            mean = sum(rewards) / len(rewards)
            for resp, reward in zip(responses, rewards):
                mask = [1 if rng.random() > 0.05 else 0 for _ in resp]
                rollouts.append(Rollout(
                    prompt_ids=prompt, response_ids=resp, loss_mask=mask,
                    advantages=[reward - mean] * len(resp),
                    old_logprobs=[uniform + rng.uniform(-0.05, 0.05) for _ in resp],
                    ref_logprobs=[uniform + rng.uniform(-0.05, 0.05) for _ in resp],
                    numerator_mask=[m if rng.random() > 0.05 else 0 for m in mask],
                    group_id=f"s{step}-p{p}",
                ))
        steps[step] = rollouts
    return steps
