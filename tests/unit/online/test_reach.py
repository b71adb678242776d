"""The reach task, its verifier and warm-up data, the group advantages and the comparison's
summary, each against values worked out by hand (docs/length-bias.md)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_pg_agg.data.reach import BOS, EOS, ReachTask
from megatron_pg_agg.online.comparison import VARIANTS, summary_rows, trainer_flags
from megatron_pg_agg.online.grpo import group_advantages, response_stats, step_batch
from megatron_pg_agg.online.run import online_problems
from megatron_pg_agg.training.run_config import RunConfig, parse_flags

TASK = ReachTask()


def climb(*totals, end=True):
    """A response writing ``totals`` (then EOS)."""
    return [TASK.number(v) for v in totals] + ([EOS] if end else [])


@pytest.mark.parametrize("target,response,reward", [
    (11, climb(2, 5, 6, 9, 11), 1.0),                 # the docstring's example
    (5, climb(3, 5), 1.0),
    (11, climb(3, 6, 9, 12), 0.0),                    # overshot
    (11, climb(3, 6, 9, 12, 13, 15), 0.0),            # overshot and kept going
    (11, climb(2, 5, 6, 9), 0.0),                     # stopped short
    (11, climb(2, 5, 6, 9, 11, end=False), 0.0),      # never ended
    (11, climb(4, 7, 10, 11), 0.0),                   # a step of +4
    (11, climb(2, 2, 5, 8, 11), 0.0),                 # a step of 0
    (11, climb(2, 5, 3, 6, 9, 11), 0.0),              # a step back
    (11, [EOS], 0.0),                                 # total 0
    (11, [BOS, *climb(3, 6, 9, 11)], 0.0),            # a non-number token
    (11, climb(2, 5, 6, 9, 11) + [EOS], 0.0),         # EOS in the middle: 11 then an EOS "step"
])
def test_reward_is_one_only_for_a_valid_climb_ending_on_the_target(target, response, reward):
    assert TASK.reward(target, response) == reward


def test_a_response_longer_than_the_limit_scores_zero():
    task = ReachTask(max_response_tokens=4)
    assert task.reward(6, climb(1, 2, 4, 6)) == 0.0  # 5 tokens with EOS
    assert task.reward(6, climb(2, 4, 6)) == 1.0


def test_token_ids_and_sizes():
    assert TASK.prompt(11) == [BOS, 3 + 11]
    assert TASK.largest_number == 96  # 32 steps of +3
    assert TASK.vocab_size == 3 + 97
    assert TASK.prompt_tokens == 2


def test_demonstrations_follow_their_rules_and_start_near_a_quarter_correct():
    rng = random.Random(0)
    targets = TASK.targets(4000, rng)
    demos = [TASK.demonstration(t, rng) for t in targets]
    for t, d in zip(targets[:500], demos[:500]):
        totals = [tok - 3 for tok in d if tok != EOS]
        steps = [b - a for a, b in zip([0] + totals, totals)]
        assert all(1 <= s <= 3 for s in steps)
        assert d[-1] == EOS or len(d) == TASK.max_response_tokens
        if d[-1] == EOS and totals:
            assert totals[-1] >= t  # EOS only on or past the target
    accuracy = sum(TASK.reward(t, d) for t, d in zip(targets, demos)) / len(demos)
    # P(land on T) * P(stop there): about 0.5 * 0.5 in the limit of large targets, less for a few small
    # ones that are often passed; 4000 draws put the estimate within +-0.02 (2 sigma)
    assert 0.2 < accuracy < 0.32
    overshot = [d for t, d in zip(targets, demos) if TASK.reward(t, d) == 0 and d[-1] == EOS]
    # after an overshoot each token continues with probability 0.7: the mean number of tokens past the
    # first total above T is 0.7 / 0.3 = 2.33
    past = [sum(1 for tok in d[:-1] if tok - 3 > t) - 1 for t, d in zip(targets, demos)
            if TASK.reward(t, d) == 0 and d[-1] == EOS and any(tok - 3 > t for tok in d[:-1])]
    assert overshot and abs(sum(past) / len(past) - 0.7 / 0.3) < 0.15


def test_targets_are_uniform_over_the_range():
    drawn = TASK.targets(20000, random.Random(1))
    assert min(drawn) == 5 and max(drawn) == 24
    assert all(abs(drawn.count(t) / 20000 - 1 / 20) < 0.01 for t in range(5, 25))


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # two groups of 4
    plain = group_advantages(rewards, 4, divide_by_std=False)
    assert plain.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    scaled = group_advantages(rewards, 4, divide_by_std=True)
    std = math.sqrt((0.75 ** 2 + 3 * 0.25 ** 2) / 3)  # unbiased: 0.5
    assert std == pytest.approx(0.5)
    assert scaled.tolist() == pytest.approx([0.75 / (std + 1e-6), *[-0.25 / (std + 1e-6)] * 3, 0, 0, 0, 0])


def test_step_batch_carries_each_response_with_its_group_prompt_and_advantage():
    targets = [7, 9]
    responses = [climb(3, 6, 7), climb(3, 6, 9, 10), climb(2, 4, 6, 9), [EOS]]
    logprobs = [[-0.1 * (i + 1)] * len(r) for i, r in enumerate(responses)]
    batch = step_batch(TASK, targets, responses, logprobs, torch.tensor([0.5, -0.5, 1.0, -1.0]), 2)
    assert batch.group_index.tolist() == [0, 0, 1, 1]
    assert batch.prompt_tokens.tolist() == TASK.prompt(7) * 2 + TASK.prompt(9) * 2
    assert batch.response_lengths.tolist() == [4, 5, 5, 1]
    assert batch.advantages.tolist() == pytest.approx([0.5] * 4 + [-0.5] * 5 + [1.0] * 5 + [-1.0])
    assert batch.old_logprobs.tolist() == pytest.approx([-0.1] * 4 + [-0.2] * 5 + [-0.3] * 5 + [-0.4])
    assert bool(batch.loss_mask.all())


def test_response_stats_by_hand():
    responses = [climb(3, 6, 7), climb(3, 6, 9, 10), climb(1, 2, end=False), climb(2, 4, 6, 9)]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    stats = response_stats(rewards, responses, TASK)
    assert stats == {"accuracy": 0.5, "response_length": (4 + 5 + 2 + 5) / 4, "length_correct": (4 + 5) / 2,
                     "length_incorrect": (5 + 2) / 2, "truncated": 0.25, "responses": 4}
    assert math.isnan(response_stats(torch.ones(1), [climb(5)], TASK)["length_incorrect"])


def test_the_comparison_refuses_a_group_of_one_and_no_steps():
    def problems(flags, steps):
        return online_problems(RunConfig.from_args(parse_flags(trainer_flags(TASK, "token_mean", flags))), steps, 1)

    assert problems([], 1) == []
    assert problems(["--group-size", "1"], 0) == [
        "--group-size must be >= 2 (group-relative advantages), --prompts-per-step and --updates-per-batch >= 1",
        "--steps 0 must be >= 1"]


def test_variants_are_the_papers_objectives():
    by_name = {v.name: (v.mode, v.divide_by_std) for v in VARIANTS}
    assert by_name == {"grpo": ("seq_mean", True), "dapo": ("token_mean", True), "dr_grpo": ("constant", False),
                       "seq_mean_no_std": ("seq_mean", False), "constant_std": ("constant", True)}
    flags = trainer_flags(TASK, "constant", ["--hidden-size", "32"])
    assert flags[flags.index("--pg-loss-aggregation-divisor") + 1] == "32"  # L = the longest response
    assert flags[-2:] == ["--hidden-size", "32"] and "--no-pg-plan-ahead" in flags
    assert "--pg-loss-aggregation-divisor" not in trainer_flags(TASK, "seq_mean", [])


def _records(variant, seed, lengths, accuracy=0.5):
    return [{"variant": variant, "seed": seed, "step": i, "accuracy": accuracy, "length_incorrect": v,
             "length_correct": 5.0, "truncated": 0.0} for i, v in enumerate(lengths)]


def test_summary_quarters_and_ratio_by_hand():
    records = (_records("grpo", 0, [10, 10, 10, 10, 20, 20, 30, 30]) + _records("grpo", 1, [8] * 6 + [10, 14])
               + _records("dr_grpo", 0, [9] * 6 + [10, 10]) + _records("dr_grpo", 1, [9] * 6 + [float("nan"), 12]))
    rows = {r["variant"]: r for r in summary_rows(records)}
    assert rows["grpo"]["length_incorrect_first"] == pytest.approx((10 + 8) / 2)
    assert rows["grpo"]["length_incorrect_last"] == pytest.approx((30 + 12) / 2)  # quarter = the last 2 steps
    assert rows["grpo"]["length_incorrect_last_by_seed"] == pytest.approx([30, 12])
    assert rows["dr_grpo"]["length_incorrect_last"] == pytest.approx((10 + 12) / 2)  # a NaN step is skipped
    assert rows["grpo"]["incorrect_vs_dr_grpo"] == pytest.approx(21 / 11)
    assert rows["dr_grpo"]["incorrect_vs_dr_grpo"] == 1.0
