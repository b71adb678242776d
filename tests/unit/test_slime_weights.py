"""The slime plug-in's per-sample denominators (host side, no slime import except its step grouping).

slime trains ``J_slime = (1/gbs) sum_i sum_t n_it l_it / clamp_min(D_i, 1)`` per optimizer step
(megatron_pg_agg/integrations/slime/weights.py). Here that expression is evaluated in float64 on the
plug-in's ``D_i`` and compared with the README's mode formulas written out below (no package
aggregation code); the distributed test runs slime's own loss in megatron-core's schedule.
"""
from __future__ import annotations

import os
import random
import sys
from types import SimpleNamespace

import pytest

from megatron_pg_agg.integrations.objective import HostObjective
from megatron_pg_agg.integrations.slime.plugin import (
    CHECKOUT_ENV,
    checkout_problem,
    config_problems,
    objective_from_args,
)
from megatron_pg_agg.integrations.slime.weights import SlimeConfigError, step_denominators
from tests.support.optional import require

REQUIRE_SLIME = "MEGATRON_PG_AGG_REQUIRE_SLIME"


def make_rollout(seed: int, groups=(3, 2, 3, 4), steps=2):
    """Ragged prompt groups; per sample a denominator mask (some masked tokens, one fully masked
    sample) and a numerator mask inside it (a filtered token, one removed sample)."""
    rng = random.Random(seed)
    den, num, group_ids = [], [], []
    for g, size in enumerate(groups):
        for _ in range(size):
            length = rng.randint(2, 9)
            d = [1 if rng.random() > 0.15 else 0 for _ in range(length)]
            d[0] = 1
            den.append(d)
            num.append([v if rng.random() > 0.1 else 0 for v in d])
            group_ids.append(g)
    den[4] = [0] * len(den[4])  # fully masked: inactive
    num[4] = list(den[4])
    num[7] = [0] * len(num[7])  # removed (slime's remove_sample): out of the numerator only
    losses = [[rng.uniform(-2, 2) for _ in d] for d in den]
    # steps of whole groups: the first two groups, then the rest
    cut = sum(groups[: len(groups) // 2])
    return den, num, group_ids, losses, [list(range(cut)), list(range(cut, len(den)))][:steps]


def reference(mode, den, num, group_ids, losses, step, divisor=None) -> float:
    """The README's objective of one step, float64, written out."""
    def s(i):
        return sum(x for x, m in zip(losses[i], num[i]) if m)
    active = [i for i in step if sum(den[i]) > 0]
    if mode == "token_mean":
        total = sum(sum(den[i]) for i in step)
        return sum(s(i) for i in step) / total if total else 0.0
    if mode == "seq_mean":
        return sum(s(i) / sum(den[i]) for i in active) / len(active) if active else 0.0
    if mode == "constant":
        return sum(s(i) for i in step) / (len(active) * divisor) if active else 0.0
    groups = {}
    for i in step:
        groups.setdefault(group_ids[i], []).append(i)
    active_groups = [m for m in groups.values() if sum(sum(den[i]) for i in m) > 0]
    return sum(sum(s(i) for i in m) / sum(sum(den[i]) for i in m) for m in active_groups) / len(active_groups)


def slime_objective(D, num, losses, step, gbs) -> float:
    """slime's per-step objective on the D_i (its get_sum_of_sample_mean and the 1/gbs step factor)."""
    return sum(sum(x for x, m in zip(losses[i], num[i]) if m) / max(D[i], 1.0) for i in step) / gbs


MODES = [("token_mean", None), ("seq_mean", None), ("prompt_mean", None), ("constant", 7.0)]


@pytest.mark.parametrize("mode,divisor", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_slimes_objective_on_the_denominators_is_the_mode_formula(mode, divisor, seed):
    """Every mode, two steps of whole groups, a filtered token, a removed and an inactive sample:
    slime's expression on the plug-in's D_i equals the formula (float64, 1e-6; D_i pass through
    float32 coefficients). Catches W or c_i per sample instead of per step, the numerator mask used
    as the denominator (the removed sample would leave N, S or T_g), gbs left out."""
    den, num, group_ids, losses, steps = make_rollout(seed)
    gbs = 3  # small next to the units, so that no D_i is refused
    D = step_denominators(den, num, steps, group_ids, global_batch_size=gbs,
                          objective=HostObjective(mode, divisor))
    for step in steps:
        want = reference(mode, den, num, group_ids, losses, step, divisor)
        got = slime_objective(D, num, losses, step, gbs)
        assert abs(got - want) <= 1e-6 * max(abs(want), 0.01), (mode, step, got, want)
    assert D[4] == 1.0  # no numerator token: any value, 1


def test_the_per_mode_denominators_are_the_documented_ones():
    """D_i = N/gbs, S*D_s/gbs, P*T_g/gbs, S*L/gbs on one hand-counted step."""
    den = [[1, 1, 0], [1, 1, 1, 1], [0, 0], [1, 1, 1]]
    num = [[1, 0, 0], [1, 1, 1, 1], [0, 0], [1, 1, 1]]
    groups = ["a", "a", "b", "b"]
    step = [[0, 1, 2, 3]]
    d = {mode: step_denominators(den, num, step, groups, global_batch_size=2, objective=HostObjective(mode, div))
         for mode, div in MODES}
    assert d["token_mean"] == pytest.approx([9 / 2, 9 / 2, 1.0, 9 / 2], rel=1e-7)
    assert d["seq_mean"] == pytest.approx([3 * 2 / 2, 3 * 4 / 2, 1.0, 3 * 3 / 2], rel=1e-7)
    assert d["prompt_mean"] == pytest.approx([2 * 6 / 2, 2 * 6 / 2, 1.0, 2 * 3 / 2], rel=1e-7)
    assert d["constant"] == pytest.approx([3 * 7 / 2, 3 * 7 / 2, 1.0, 3 * 7 / 2], rel=1e-7)


def test_a_denominator_below_one_is_refused_naming_the_samples_and_one_is_accepted():
    """prompt_mean with T_g = 3 over P = 2 groups: gbs 6 gives D = 1 (accepted, exact), gbs 7 gives
    6/7 for both samples of group 'a' and 'b' (refused, each named with its D_i and the reason)."""
    den = [[1, 1], [1], [1, 1], [1]]
    groups = ["a", "a", "b", "b"]
    ok = step_denominators(den, den, [[0, 1, 2, 3]], groups, global_batch_size=6,
                           objective=HostObjective("prompt_mean"))
    assert ok == pytest.approx([1.0] * 4, rel=1e-7)
    with pytest.raises(SlimeConfigError) as info:
        step_denominators(den, den, [[0, 1, 2, 3]], groups, global_batch_size=7,
                          objective=HostObjective("prompt_mean"), names=["s0", "s1", "s2", "s3"])
    text = str(info.value)
    for name in ("s0", "s1", "s2", "s3"):
        assert f"{name} (step 0): D_i = 0.8571" in text
    assert "clamp_min(D_i, 1)" in text and "P*T_g/gbs" in text


def test_a_removed_sample_alone_below_one_is_not_refused():
    """A sample with no numerator token adds nothing whatever its D_i (seq_mean, S*D_s/gbs < 1)."""
    den = [[1], [1, 1, 1, 1]]
    num = [[0], [1, 1, 1, 1]]
    D = step_denominators(den, num, [[0, 1]], None, global_batch_size=2, objective=HostObjective("seq_mean"))
    assert D == pytest.approx([1.0, 4.0], rel=1e-7)


def test_prompt_mean_refuses_a_group_cut_across_steps_and_missing_groups():
    den = [[1, 1]] * 4
    with pytest.raises(SlimeConfigError, match=r"group 1 over steps \[0, 1\].*--n-samples-per-prompt"):
        step_denominators(den, den, [[0, 1, 2], [3]], [0, 0, 1, 1], global_batch_size=1,
                          objective=HostObjective("prompt_mean"))
    with pytest.raises(SlimeConfigError, match=r"group 1 over steps \[0, 'the remainder slime drops'\]"):
        step_denominators(den, den, [[0, 1, 2]], [0, 0, 1, 1], global_batch_size=1,
                          objective=HostObjective("prompt_mean"))
    with pytest.raises(SlimeConfigError, match="Sample.group_index.*sample 2"):
        step_denominators(den, den, [[0, 1, 2, 3]], [0, 0, None, 1], global_batch_size=1,
                          objective=HostObjective("prompt_mean"))


def test_objective_and_flags_refused_by_name():
    with pytest.raises(SlimeConfigError, match="pg_agg_mode='constant', pg_agg_divisor=None: .*needs divisor"):
        objective_from_args(SimpleNamespace(pg_agg_mode="constant"))
    with pytest.raises(SlimeConfigError, match="pg_agg_mode='tokenmean', pg_agg_divisor=None: unknown mode"):
        objective_from_args(SimpleNamespace(pg_agg_mode="tokenmean"))
    with pytest.raises(SlimeConfigError, match="pg_agg_mode is not set"):
        objective_from_args(SimpleNamespace())
    assert objective_from_args(SimpleNamespace(pg_agg_mode="constant", pg_agg_divisor=512)) == \
        HostObjective("constant", 512.0)
    args = type("Args", (), dict(calculate_per_token_loss=True, custom_pg_loss_reducer_function_path="my.reducer",
                                 global_batch_size=8))()
    problems = config_problems(args)
    assert len(problems) == 2
    assert problems[0].startswith("--calculate-per-token-loss") and "my.reducer" in problems[1]


def _checkout() -> str:
    path = os.environ.get(CHECKOUT_ENV)
    require(checkout_problem(path), REQUIRE_SLIME)
    return os.path.abspath(path)


def _rule(rollout_ids, gbs):
    """slime's step rule as its docstring states it: rollouts in order of first appearance,
    ``gbs`` rollouts per step, each rollout's samples together, the remainder dropped."""
    order = list(dict.fromkeys(rollout_ids))
    steps = []
    for s in range(len(order) // gbs):
        chosen = order[s * gbs:(s + 1) * gbs]
        steps.append([i for r in chosen for i in range(len(rollout_ids)) if rollout_ids[i] == r])
    return steps


def test_the_step_grouping_is_slimes_build_dp_schedule():
    """slime_steps calls slime's own build_dp_schedule: its steps equal the stated rule on
    compact rollouts (several samples per rollout id, not adjacent) with a dropped remainder.
    Fails when slime changes its grouping (and the distributed test with it)."""
    sys.path.insert(0, _checkout())
    try:
        from megatron_pg_agg.integrations.slime.plugin import slime_steps

        ids = [5, 5, 2, 9, 2, 7, 7, 7, 1, 5, 3]
        for gbs in (1, 2, 3, 4):
            assert slime_steps(ids, gbs) == _rule(ids, gbs), gbs
        # by hand: rollouts 5, 2, 9, 7 in one step, 1 and 3 dropped
        assert slime_steps(ids, 4) == [[0, 1, 9, 2, 4, 3, 5, 6, 7]]
    finally:
        sys.path.remove(_checkout())
