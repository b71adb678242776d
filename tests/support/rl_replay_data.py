"""Replay rollouts for the RL-entry tests, written here from Megatron-LM's ``TokenRollout`` fields
(not from the package's built-in set), and the same rollouts seen from the reference's side.

Ragged on purpose: prompts of 2-7 tokens and completions of 1-40 (each ending in the end-of-document
id), so token_mean, seq_mean, prompt_mean and constant give different objectives; rewards differ
inside every group, so every GRPO advantage is nonzero; inference log-probs within 0.3 of the
initial model's, so the IS weights spread around 1 (some above the test's cap 1.2).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

EOD, PAD = 126, 125  # NullTokenizer --vocab-size 127: eod = 126; --null-tokenizer-pad-id 125


@dataclass
class ReplayedRollout:
    """A replayed rollout as the float64 reference reads it (the fields of ``Rollout`` it uses)."""

    prompt_ids: list
    response_ids: list
    loss_mask: list
    advantages: list
    old_logprobs: list
    ref_logprobs: list
    group_id: object
    numerator_mask: list = None
    """None: the loss mask (no filtering)."""


def write_replay(path: Path, *, groups: int, group_size: int, seed: int = 5, longest: int = 48) -> list:
    """Write ``groups`` x ``group_size`` rollouts; returns the records written."""
    rng = random.Random(seed)
    ids = list(range(1, PAD))
    records = []
    for g in range(groups):
        prompt = [rng.choice(ids) for _ in range(rng.randint(2, 7))]
        for k in range(group_size):
            completion = [rng.choice(ids) for _ in range(rng.randint(0, min(40, longest - len(prompt) - 1)))] + [EOD]
            records.append({"group": f"g{g}", "trajectory": prompt + completion,
                            "generation_mask": [0] * len(prompt) + [1] * len(completion),
                            "reward": round(rng.uniform(-1, 2), 3) + k * 0.1,
                            # near the untrained model's (log 1/127 = -4.84): IS weights around 1
                            "logprobs": [round(-4.84 + rng.uniform(-0.3, 0.3), 4) for _ in completion]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def grpo_advantages(records: list, group_size: int) -> list:
    """Per rollout ``(r - mean) / (1e-4 + std)`` over its group (population std): GRPO's advantage
    as Megatron-LM's ``calculate_grpo_advantages`` documents it, written out in float64."""
    out = []
    for start in range(0, len(records), group_size):
        rewards = [r["reward"] for r in records[start:start + group_size]]
        mean = sum(rewards) / len(rewards)
        std = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5
        out.extend((x - mean) / (1e-4 + std) for x in rewards)
    return out


def split(record: dict) -> tuple:
    first = record["generation_mask"].index(1)
    return record["trajectory"][:first], record["trajectory"][first:]
