"""The miles plug-in on miles' own code (snapshot 31f1ca9, a user's checkout given at run time) in
megatron-core 0.16.1's schedule, CPU, gloo: one torchrun launch per world size (1 rank: DP 1 x CP 1;
2 ranks: DP 2 x CP 1, then DP 1 x CP 2).

tests/distributed/workers/miles_worker.py runs, per case, miles' rollout-side conversion (its dispatch to
the plug-in's hook by the flag's dotted path) and DP split (``build_dp_schedule``, each step's
``num_rollouts``), the train side's ``get_rollout_data``, ``get_data_iterator``,
``compute_advantages_and_returns`` and ``train()`` (``get_batch``, ``loss_function`` /
``get_sum_of_sample_mean``, megatron-core's ``forward_backward_func``, DDP, ``finalize_model_grads``)
on miles' own parsed args; tests/distributed/workers/miles_critic.py runs miles' ``train_critic``
(``--advantage-estimator ppo``). The references are float64 with the README's formulas written out
(tests/distributed/workers/slime_family_cpu.py, shared with the slime tests). Stand-ins: the workers'
docstrings.

Skips without a miles checkout in ``MEGATRON_PG_AGG_MILES`` (docs/miles.md) or a Megatron-LM one
(``MEGATRON_LM_PATH``, else ``../shared/third_party/Megatron-LM``); fails instead under
``MEGATRON_PG_AGG_REQUIRE_MILES=1`` (CI's 0.16.1 leg).
"""
from __future__ import annotations

import os

import pytest

from megatron_pg_agg.integrations.miles.plugin import CHECKOUT_ENV, checkout_problem
from tests.support.slime_family import GBS, MODES, SPLITS, checkout_paths, launch_layouts, stock_token_mean_moves

REQUIRE_MILES = "MEGATRON_PG_AGG_REQUIRE_MILES"
TOL = 1e-6
"""Objective: absolute (J is 0.05 to 0.3 here; miles computes it in float32, 1e-7 to 1.4e-6 of |J|
measured); gradient: relative, the whole reduced gradient."""


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """{layout: {case: result}} from one launch per world size (every case each)."""
    miles, megatron_lm = checkout_paths(CHECKOUT_ENV, checkout_problem, REQUIRE_MILES)
    return launch_layouts(tmp_path_factory.mktemp("miles"), "miles", CHECKOUT_ENV, miles, megatron_lm)


def _errors(step: dict) -> tuple[float, float]:
    """(absolute objective error, relative gradient error)."""
    return abs(step["objective"] - step["reference"]), step["grad_error"]


def _relative(step: dict) -> float:
    return abs(step["objective"] - step["reference"]) / max(abs(step["reference"]), 0.01)


def _worst(results, prefix: str) -> dict:
    """{mode: [objective, gradient]} worst errors over ``{prefix}{mode}-{split}``, every step checked."""
    worst = {}
    for layout, cases in results.items():
        for mode in MODES:
            for split in SPLITS:
                case = cases[f"{prefix}{mode}-{split}"]
                assert len(case["steps"]) == 2, (layout, mode, split)
                for step in case["steps"]:
                    obj, grad = _errors(step)
                    assert obj <= TOL and grad <= TOL, (layout, mode, split, step)
                    assert step["increment"] == GBS  # miles' scheduler advanced by the step's num_rollouts
                    w = worst.setdefault(mode, [0.0, 0.0, 0.0])
                    w[0], w[1], w[2] = max(w[0], obj), max(w[1], _relative(step)), max(w[2], grad)
    return worst


def test_every_mode_split_and_layout_equals_the_float64_reference(results):
    """4 modes (constant with L = 12) x micro-batches static 1, static 3 and dynamic (a 30-token cap)
    x DP 1/2, CP 1/2, two optimizer steps each: J (miles' own reduced train loss) within 1e-6 and the
    reduced gradient within 1e-6 (relative) of the float64 reference. The removed sample counts in the denominator
    (filtered numerator), the fully masked one nowhere. Catches D_i per micro-batch or rank, the
    numerator mask as the denominator, a step grouping or divisor that is not miles' (the reference
    groups the steps itself), the CP chunks' denominators."""
    worst = _worst(results, "")
    print("miles worst per mode (objective absolute, relative; gradient): " + "; ".join(
        f"{m} {o:.1e} {r:.1e} {g:.1e}" for m, (o, r, g) in worst.items()))


def test_the_schedule_is_miles_own(results):
    """The splits really differ (micro-batches per rank and step: static --micro-batch-size over the DP
    size, dynamic the token cap times CP) and every step divides by num_rollouts = 6."""
    expected = {"dp1cp1": {"static1": [6, 6], "static3": [2, 2]}, "dp2cp1": {"static1": [3, 3], "static3": [1, 1]},
                "dp1cp2": {"static1": [6, 6], "static3": [2, 2]}}
    for layout, cases in results.items():
        for split, counts in expected[layout].items():
            assert cases[f"token_mean-{split}"]["num_microbatches"] == counts, (layout, split)
        dynamic = cases["token_mean-dynamic"]["num_microbatches"]
        assert dynamic != expected[layout]["static1"], (layout, dynamic)
        assert all(cases[f"{m}-{s}"]["num_rollouts"] == [GBS, GBS] for m in MODES for s in SPLITS), layout


def test_the_train_sides_legacy_split_is_exact_too(results):
    """--delay-split-train-data-by-dp: miles splits on the train side (steps of --global-batch-size
    samples, divisor --global-batch-size); prompt_mean with dynamic micro-batches stays exact."""
    for layout, cases in results.items():
        case = cases["prompt_mean-legacy-split"]
        assert "num_rollouts" in case and len(case["steps"]) == 2, layout
        for step in case["steps"]:
            obj, grad = _errors(step)
            assert obj <= TOL and grad <= TOL, (layout, step)


def test_control_miles_stock_sample_mean_is_divided_by_num_rollouts(results):
    """miles' own loss, no plug-in (--calculate-per-token-loss off): per step (1/num_rollouts) sum_i
    sum_t m l / clamp_min(rollout_mask_sums_i, 1), the mean over rollouts of each one's token mean
    with a fully masked (or removed) rollout counted in num_rollouts: J and the gradient are
    seq_mean's over the active samples times S / 6 (5/6 here, one inactive sample per step)."""
    for cases in results.values():
        for split in SPLITS:
            for step in cases[f"stock-seq_mean-{split}"]["steps"]:
                factor = (GBS - step["fully_masked"]) / GBS
                assert step["fully_masked"] == 1, step
                assert abs(step["objective"] - factor * step["reference"]) <= 1e-6 * abs(step["reference"]), step
                assert abs(step["grad_error"] - (1 - factor)) <= 1e-5, step


def test_control_miles_stock_token_mean_moves_with_a_fully_masked_sample(results):
    """miles' own --calculate-per-token-loss, no plug-in: exact without a fully masked sample; with one
    (sample 4; sample 7 removed, which miles masks whole) each step's J and gradient are the
    reference's times N / (N + k): clamp_min(mask sum, 1) counts each fully masked sample as a token."""
    moved = stock_token_mean_moves(results, SPLITS, lambda step: max(_errors(step)) <= TOL)
    print(f"miles' stock token mean with one fully masked sample: J and gradient off by "
          f"{min(moved):.2%} to {max(moved):.2%}")


def test_miles_default_log_probs_round_the_gradient_to_bfloat16(results):
    """Without --true-on-policy-mode miles' log-probs go through megatron-core's fused vocab-parallel
    cross entropy, whose backward casts the logits' gradient to bfloat16: the objective stays exact,
    the gradient is off by 1e-4 to 1e-2 (with or without the plug-in; every other case runs miles'
    float32 log_softmax path)."""
    errors = []
    for layout, cases in results.items():
        for step in cases["token_mean-fused-ce"]["steps"]:
            obj, grad = _errors(step)
            assert obj <= TOL and 1e-4 < grad < 1e-2, (layout, step)
            errors.append(grad)
    print(f"miles' fused cross entropy: gradient error {min(errors):.1e} to {max(errors):.1e}")


def test_refusals_name_the_samples_and_the_flags(results):
    """constant with L = 1 (D_i = S*L/R = 5/6 in step 0): the hook refuses before anything trains,
    naming each active sample of step 0 with its D_i; --use-dynamic-global-batch-size is refused by name."""
    for layout, cases in results.items():
        text = cases["refused-constant-L1"]["refused"]
        assert "clamp_min(D_i, 1)" in text and "num_rollouts" in text, text
        for i in (0, 1, 2, 3, 5):
            assert f"sample {i} (Sample.index {i}, group_index {i // 3}) (step 0): D_i = 0.8333" in text, (layout, i)
        assert "sample 4 " not in text and "(step 1)" not in text, text
        assert "--use-dynamic-global-batch-size" in cases["refused-dynamic-global-batch-size"]["refused"], layout


def test_the_critic_follows_every_mode_split_and_layout(results):
    """miles' critic (its own train_critic: forward_only values, miles' GAE over the trainable tokens,
    value_loss_function through get_sum_of_sample_mean) on the hook's rollout_mask_sums: J_v =
    sum_t c_t n_t v_t / W equals the float64 reference within 1e-6 in every mode, split and layout;
    step 1 trains partly in the value clip."""
    worst = _worst(results, "critic-")
    for layout, cases in results.items():
        for mode in MODES:
            for split in SPLITS:
                first, second = cases[f"critic-{mode}-{split}"]["steps"]
                assert first["clipped"] == 0 and 0 < second["clipped"] < second["tokens"], (layout, mode, split)
    print("miles critic worst per mode (objective absolute, relative; gradient): " + "; ".join(
        f"{m} {o:.1e} {r:.1e} {g:.1e}" for m, (o, r, g) in worst.items()))


def test_control_miles_stock_value_loss_is_seq_mean_over_num_rollouts(results):
    """miles' own value loss, the plug-in off: exactly seq_mean when every sample is active; with an
    inactive one per step J_v and its gradient are seq_mean's times S/6 = 5/6."""
    for layout, cases in results.items():
        for split in SPLITS:
            for step in cases[f"stock-critic-clean-{split}"]["steps"]:
                obj, grad = _errors(step)
                assert step["active"] == GBS and obj <= TOL and grad <= TOL, (layout, split, step)
            for step in cases[f"stock-critic-{split}"]["steps"]:
                factor = step["active"] / GBS
                assert step["active"] == GBS - 1, step
                assert abs(step["objective"] - factor * step["reference"]) <= 1e-6 * abs(step["reference"]), step
                assert abs(step["grad_error"] - (1 - factor)) <= 1e-5, step


def test_the_skip_reason_names_the_variable_or_the_folder():
    assert CHECKOUT_ENV in checkout_problem(None)
    assert "not a miles checkout" in checkout_problem(os.path.dirname(__file__))
