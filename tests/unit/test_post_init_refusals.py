"""Every refusal written in a ``__post_init__`` has a test of its own here (or, where named, in
the module that already had one): PGLossConfig (core/losses.py), RolloutBatch's structure
(data/rollouts.py), and the patch machinery's Target and Patch (patches/_machinery.py). Each
test builds one otherwise valid object with a single fault and checks the message names it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.rollouts import PlanError, RolloutBatch
from megatron_pg_agg.patches._machinery import Patch, Target

# ----------------------------------------------------------------------------- PGLossConfig


def test_a_valid_loss_config_passes():
    cfg = PGLossConfig(mode="constant", divisor=4.0, clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0,
                       kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01, rollout_correction="token_mask",
                       rollout_correction_max=2.0, rollout_correction_min=0.5)
    assert cfg.mode == "constant" and cfg.clip_eps_high == 0.28


@pytest.mark.parametrize("kwargs,words", [
    ({"clip_eps_low": 0.0}, ["clip_eps_low must be in (0, 1); got 0.0"]),
    ({"clip_eps_low": 1.0}, ["clip_eps_low must be in (0, 1); got 1.0"]),
    ({"clip_eps_high": 0.0}, ["clip_eps_high must be positive; got 0.0"]),
    ({"dual_clip": 1.0}, ["dual_clip must be > 1", "got 1.0"]),
    ({"kl_estimator": "k4"}, ["kl_estimator must be one of", "'k4'"]),
    ({"kl_coef": -0.1}, ["kl_coef and entropy_coef must be >= 0; got -0.1, 0.0"]),
    ({"entropy_coef": -0.5}, ["kl_coef and entropy_coef must be >= 0; got 0.0, -0.5"]),
    ({"policy_loss": "reinforce"}, ["policy_loss must be one of", "'reinforce'"]),
    ({"dual_clip": 3.0, "policy_loss": "gspo"}, ["dual_clip applies to the ppo policy loss only", "'gspo'"]),
    ({"rollout_correction": "token_clip"}, ["rollout_correction must be one of", "'token_clip'"]),
    ({"rollout_correction_max": 1.0, "rollout_correction_min": 1.0}, ["C > c >= 0", "C=1.0, c=1.0"]),
    ({"rollout_correction_min": -0.1}, ["C > c >= 0", "c=-0.1"]),
    ({"mode": "token_mean", "divisor": 3.0}, ["divisor"]),  # resolve_mode (core/modes.py has the full set)
])
def test_each_loss_config_refusal(kwargs, words):
    with pytest.raises(ValueError) as err:
        PGLossConfig(**kwargs)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


# ----------------------------------------------------------------------------- RolloutBatch


def _batch(**changes) -> RolloutBatch:
    """Two rollouts: prompts of 2 and 1 tokens, responses of 3 and 2."""
    fields = dict(
        prompt_lengths=torch.tensor([2, 1]), response_lengths=torch.tensor([3, 2]),
        prompt_tokens=torch.tensor([5, 6, 7]), response_tokens=torch.tensor([1, 2, 3, 4, 5]),
        loss_mask=torch.ones(5, dtype=torch.bool), advantages=torch.zeros(5), old_logprobs=torch.full((5,), -1.0),
        group_index=torch.tensor([0, 0]))
    fields.update(changes)
    return RolloutBatch(**fields)


def test_a_valid_batch_passes():
    assert len(_batch()) == 2 and len(_batch(group_labels=["g"])) == 2


@pytest.mark.parametrize("changes,words", [
    ({"advantages": torch.zeros(5, dtype=torch.float64)}, ["advantages is a 1-D torch.float64 tensor",
                                                          "expected a 1-D torch.float32 tensor"]),
    ({"prompt_lengths": [2, 1]}, ["prompt_lengths is list"]),
    ({"prompt_lengths": torch.tensor([], dtype=torch.long), "response_lengths": torch.tensor([], dtype=torch.long),
      "group_index": torch.tensor([], dtype=torch.long)}, ["the step has no rollouts"]),
    ({"prompt_tokens": torch.tensor([5, 6])}, ["prompt_tokens holds 2 ids but prompt_lengths sum to 3"]),
    ({"old_logprobs": torch.full((4,), -1.0)}, ["old_logprobs holds 4 entries but response_lengths sum to 5"]),
    ({"group_index": torch.tensor([0])}, ["group_index holds 1 entries for 2 rollouts"]),
    ({"group_index": torch.tensor([0, 2]), "group_labels": ["a", "b"]},
     ["group_index spans [0, 2] but group_labels has 2 entries"]),
])
def test_each_batch_structure_refusal(changes, words):
    with pytest.raises(PlanError) as err:
        _batch(**changes)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_batch_value_refusals_have_their_own_tests():
    """RolloutBatch._check_values' refusals (negative ids, non-finite values, positive log-probs,
    a numerator outside the loss mask) are tested one by one in tests/unit/data/test_rollout_checks.py."""
    from tests.unit.data import test_rollout_checks

    names = [n for n in dir(test_rollout_checks) if n.startswith("test_")]
    assert len(names) >= 10


# ----------------------------------------------------------------------------- the patch machinery


def test_a_target_with_a_malformed_release_range_is_refused_where_it_is_written():
    with pytest.raises(Exception, match="Invalid specifier"):
        Target("megatron.core.utils", "torch", lambda o: o, releases="0.19")


def test_a_patch_with_a_malformed_range_or_no_targets_is_refused_where_it_is_written():
    target = Target("megatron.core.utils", "torch", lambda o: o)
    with pytest.raises(Exception, match="Invalid specifier"):
        Patch(name="x", supported="0.19", why="test", targets=(target,))
    with pytest.raises(ValueError, match="patch 'x' has no targets"):
        Patch(name="x", supported=">=0.15", why="test", targets=())
    assert dataclasses.is_dataclass(Patch(name="x", supported=">=0.15", why="test", targets=(target,)))
