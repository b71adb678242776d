"""The miles plug-in on the host side: its refusals by miles' flags, its step grouping (miles' own
``build_dp_schedule``, per-step ``num_rollouts``) and the shared denominators with a per-step divisor.

miles trains ``J_miles = (1/R) sum_i sum_t n_it l_it / clamp_min(D_i, 1)`` per optimizer step, R the
step's ``num_rollouts`` (megatron_pg_agg/integrations/slime_family/weights.py). The distributed test
(tests/distributed/test_miles.py) runs miles' own conversion, loss and schedule.
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from megatron_pg_agg.integrations.miles.plugin import (
    CHECKOUT_ENV,
    MILES,
    MilesConfigError,
    checkout_problem,
    config_problems,
    miles_steps,
    objective_from_args,
    sample_problems,
)
from megatron_pg_agg.integrations.objective import HostObjective
from megatron_pg_agg.integrations.slime_family.weights import step_denominators
from tests.support.optional import require
from tests.unit.test_slime_weights import MODES, make_rollout, reference, slime_objective

REQUIRE_MILES = "MEGATRON_PG_AGG_REQUIRE_MILES"
BASE = dict(calculate_per_token_loss=False, custom_pg_loss_reducer_function_path=None, global_batch_size=4,
            use_dynamic_global_batch_size=False, multi_lora=False, indep_dp=False, train_backend="megatron",
            use_torch_fsdp2=False, use_megatron_fsdp=False, object_store_backend="ray")


def _args(**overrides):
    return SimpleNamespace(**{**BASE, **overrides})


@pytest.mark.parametrize("flag,value,named", [
    ("calculate_per_token_loss", True, "--calculate-per-token-loss"),
    ("custom_pg_loss_reducer_function_path", "my.reducer", "--custom-pg-loss-reducer-function-path=my.reducer"),
    ("use_dynamic_global_batch_size", True, "--use-dynamic-global-batch-size"),
    ("multi_lora", True, "--multi-lora"),
    ("indep_dp", True, "--indep-dp"),
    ("train_backend", "fsdp", "--train-backend=fsdp"),
    ("use_torch_fsdp2", True, "--use-torch-fsdp2: the plug-in's objective is verified with megatron-core's DDP"),
    ("use_megatron_fsdp", True, "--use-megatron-fsdp: "),
    ("object_store_backend", "mooncake", "--object-store-backend=mooncake"),
    ("global_batch_size", None, "--global-batch-size=None"),
])
def test_each_refused_flag_is_named_alone(flag, value, named):
    assert config_problems(_args()) == []
    problems = config_problems(_args(**{flag: value}))
    assert len(problems) == 1 and problems[0].startswith(named), problems


def test_multimodal_samples_are_refused():
    plain = SimpleNamespace(multimodal_train_inputs=None)
    image = SimpleNamespace(multimodal_train_inputs={"pixel_values": 0})
    assert sample_problems([plain, plain]) == []
    assert "samples [1]" in sample_problems([plain, image])[0]


def test_the_objective_comes_from_the_config_block_and_is_refused_as_miles():
    assert objective_from_args(SimpleNamespace(pg_agg_mode="constant", pg_agg_divisor=64)) == \
        HostObjective("constant", 64.0)
    with pytest.raises(MilesConfigError, match="pg_agg_mode is not set"):
        objective_from_args(SimpleNamespace())


@pytest.mark.parametrize("mode,divisor", MODES)
def test_miles_objective_on_the_denominators_is_the_mode_formula_with_a_partial_step(mode, divisor):
    """Two steps with different R (a full step of 3 rollouts, a partial one of 2, as under
    --allow-partial-train-step): miles' expression on the D_i equals each step's mode formula
    (float64, 1e-6). Catches one R for every step (slime's rule) where miles has per-step counts."""
    den, num, group_ids, losses, steps = make_rollout(1)
    sizes = [3, 2]
    D = step_denominators(den, num, steps, group_ids, step_sizes=sizes, objective=HostObjective(mode, divisor),
                          host=MILES)
    for step, size in zip(steps, sizes):
        want = reference(mode, den, num, group_ids, losses, step, divisor)
        assert abs(slime_objective(D, num, losses, step, size) - want) <= 1e-6 * max(abs(want), 0.01), (mode, step)


def test_a_denominator_below_one_names_miles_divisor():
    with pytest.raises(MilesConfigError, match=r"S\*L/R .*num_rollouts.*miles' get_sum_of_sample_mean"):
        step_denominators([[1, 1]] * 2, [[1, 1]] * 2, [[0, 1]], None, step_sizes=[4],
                          objective=HostObjective("constant", 1.0), host=MILES)


def test_the_train_sides_legacy_split_takes_global_batch_size_samples():
    """--delay-split-train-data-by-dp (or fewer rollouts than a step): miles splits on the train side,
    --global-batch-size samples per step in order, the remainder dropped; with --balance-data refused."""
    args = _args(global_batch_size=2, delay_split_train_data_by_dp=True, balance_data=False)
    assert miles_steps([7, 7, 3, 3, 9], args) == ([[0, 1], [2, 3]], [2, 2])
    with pytest.raises(MilesConfigError, match="--balance-data"):
        miles_steps([7, 7, 3, 3, 9], _args(global_batch_size=2, delay_split_train_data_by_dp=True, balance_data=True))


def _checkout() -> str:
    path = os.environ.get(CHECKOUT_ENV)
    require(checkout_problem(path), REQUIRE_MILES)
    return os.path.abspath(path)


def _rule(rollout_ids, gbs, partial):
    """miles' step rule as its docstrings state it: rollouts in order of first appearance, ``gbs`` per
    step with each rollout's samples together; the trailing rollouts dropped, or one smaller step."""
    order = list(dict.fromkeys(rollout_ids))
    sizes = [gbs] * (len(order) // gbs) + ([len(order) % gbs] if partial and len(order) % gbs else [])
    steps, start = [], 0
    for size in sizes:
        chosen = order[start:start + size]
        start += size
        steps.append([i for r in chosen for i in range(len(rollout_ids)) if rollout_ids[i] == r])
    return steps, sizes


@pytest.mark.parametrize("partial", [False, True])
def test_the_step_grouping_is_miles_build_dp_schedule(partial):
    """miles_steps calls miles' own build_dp_schedule: its steps and num_rollouts equal the stated rule
    on compact rollouts (several samples per rollout id, not adjacent), with the trailing rollouts
    dropped, or trained as a partial step under --allow-partial-train-step with dynamic micro-batches."""
    sys.path.insert(0, _checkout())
    try:
        ids = [5, 5, 2, 9, 2, 7, 7, 7, 1, 5, 3]
        for gbs in (1, 2, 4, 5):
            args = _args(global_batch_size=gbs, allow_partial_train_step=partial, use_dynamic_batch_size=True)
            assert miles_steps(ids, args) == _rule(ids, gbs, partial), gbs
        args = _args(global_batch_size=4, allow_partial_train_step=partial, use_dynamic_batch_size=True)
        assert miles_steps(ids, args)[0][0] == [0, 1, 9, 2, 4, 3, 5, 6, 7]  # by hand: rollouts 5, 2, 9, 7
        static = _args(global_batch_size=4, allow_partial_train_step=True, use_dynamic_batch_size=False)
        assert miles_steps(ids, static) == _rule(ids, 4, False)  # miles' partial step needs dynamic batches
    finally:
        sys.path.remove(_checkout())
