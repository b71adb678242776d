"""The slime plug-in's start-up refusals for slime's per-role args (``--megatron-config-path``), host side.

slime's ``create_actor_model`` / ``create_training_models`` give each role's Megatron process the base
args with that role's YAML overrides (slime's ``parse_megatron_role_args``); the conversion hook sees
only the base args, so it parses the roles itself. Here the roles' args are stubbed; the distributed
test (tests/distributed/test_slime.py) runs slime's own ``parse_megatron_role_args`` on a YAML.
"""
from __future__ import annotations

import types

import pytest

from megatron_pg_agg.integrations.slime import plugin as slime_plugin
from megatron_pg_agg.integrations.slime.plugin import config_problems, role_args

BASE = dict(calculate_per_token_loss=False, custom_pg_loss_reducer_function_path=None, global_batch_size=8,
            megatron_config_path="roles.yaml", use_critic=True)


def _args(**overrides):
    return types.SimpleNamespace(**{**BASE, **overrides})


@pytest.fixture
def roles(monkeypatch):
    """``{role: overrides}`` the stubbed ``role_args`` applies to the base args."""
    table = {"actor": {}, "critic": {}}
    monkeypatch.setattr(slime_plugin, "role_args",
                        lambda args, role: types.SimpleNamespace(**{**vars(args), **table[role]}))
    return table


def test_each_roles_overrides_are_refused_naming_the_yaml_and_the_role(roles):
    """The actor's policy loss reads both flags, the critic's value loss only
    --calculate-per-token-loss (its reducer is always get_sum_of_sample_mean)."""
    roles["actor"].update(custom_pg_loss_reducer_function_path="my.reducer")
    roles["critic"].update(calculate_per_token_loss=True, custom_pg_loss_reducer_function_path="my.reducer")
    problems = config_problems(_args())
    assert len(problems) == 2, problems
    assert problems[0].startswith("--megatron-config-path roles.yaml (actor overrides): "
                                  "--custom-pg-loss-reducer-function-path=my.reducer")
    assert problems[1].startswith("--megatron-config-path roles.yaml (critic overrides): --calculate-per-token-loss")


def test_the_critic_role_is_read_only_with_a_critic(roles):
    """Without --advantage-estimator ppo (slime's use_critic) slime starts no critic: its entry is moot."""
    roles["critic"].update(calculate_per_token_loss=True)
    assert config_problems(_args(use_critic=False)) == []
    assert len(config_problems(_args(use_critic=True))) == 1


def test_a_base_flag_the_roles_inherit_is_named_once(roles):
    problems = config_problems(_args(calculate_per_token_loss=True))
    assert len(problems) == 1 and problems[0].startswith("--calculate-per-token-loss"), problems


def test_a_role_turning_a_base_flag_off_does_not_hide_the_base_one(roles):
    """Conservative: the base flag is refused even where a role turns it off (once, unprefixed), so
    that the fix is in one place, the launch's flags."""
    roles["critic"].update(calculate_per_token_loss=False)
    problems = config_problems(_args(calculate_per_token_loss=True))
    assert len(problems) == 1 and problems[0].startswith("--calculate-per-token-loss"), problems


def test_without_a_megatron_config_path_the_roles_are_the_base_args():
    args = _args(megatron_config_path=None)
    assert role_args(args, "critic") is args
    assert config_problems(args) == []


def test_megatron_fsdp_wrappers_are_refused_naming_the_flags(roles):
    """--use-torch-fsdp2 and --use-megatron-fsdp (Megatron-LM's flags in slime's argv, in the base args
    or a role's overrides): each refused naming the flag; off, nothing."""
    (problem,) = config_problems(_args(use_torch_fsdp2=True, megatron_config_path=None))
    assert problem.startswith("--use-torch-fsdp2: ") and "does not scale gradients" in problem, problem
    (problem,) = config_problems(_args(use_megatron_fsdp=True, megatron_config_path=None))
    assert problem.startswith("--use-megatron-fsdp: ") and "#7452, finding 12" in problem, problem
    roles["critic"].update(use_torch_fsdp2=True)
    (problem,) = config_problems(_args())
    assert problem.startswith("--megatron-config-path roles.yaml (critic overrides): --use-torch-fsdp2: "), problem
    roles["critic"].clear()
    assert config_problems(_args(use_torch_fsdp2=False, use_megatron_fsdp=False)) == []
