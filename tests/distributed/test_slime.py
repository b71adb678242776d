"""The slime plug-in on slime's own code (snapshot 624b824, a user's checkout given at run time) in
megatron-core 0.16.1's schedule, CPU, gloo: one torchrun launch per world size (1 rank: DP 1 x CP 1;
2 ranks: DP 2 x CP 1, then DP 1 x CP 2).

tests/distributed/workers/slime_worker.py runs, per case, slime's rollout manager conversion (its
dispatch to the plug-in's hook by the flag's dotted path), its ``_split_train_data_by_dp``
(``build_dp_schedule``), the train actor's ``_get_rollout_data``, ``compute_advantages_and_returns``, and its
``train()`` (``get_batch``, ``loss_function`` / ``get_sum_of_sample_mean``, megatron-core's
``forward_backward_func``, DDP, ``finalize_model_grads``) on slime's own parsed args; the reference is
the same model in float64 with the README's formulas written out in the worker. The same launches
run slime's critic (``--advantage-estimator ppo``; tests/distributed/workers/slime_critic.py): its
``train_critic`` (``forward_only(get_values)``, PPO GAE, ``value_loss_function``) on the hook's
``rollout_mask_sums``, against a float64 reference of the value term in each mode.

Stand-ins (named in the worker's docstring, where they are installed): inert modules for what
slime imports but this path never calls (whole packages: ``httpx``, ``wandb``, ``requests``,
``urllib3``, ``sglang``, ``sglang_router``, ``ray.util``, ``ray.actor``, ``torch_memory_saver``,
``transformers``);
``ray.remote`` / ``ray.put`` / ``ray.get`` (one process holds both sides); a silent ``tqdm``; a CPU
accelerator through slime's own ``set_accelerator``; the project's ``PerTokenLM`` as the model
(CP without Transformer Engine's ring attention: each token's logits depend on that token only);
an optimizer that records the reduced gradient (and steps by SGD for the critic);
megatron-core on CPU through the project's ``cpu_gloo`` and ``megatron_lm_cpu`` patches.

Skips without a slime checkout in ``MEGATRON_PG_AGG_SLIME`` (docs/slime.md) or a Megatron-LM one
(``MEGATRON_LM_PATH``, else ``../shared/third_party/Megatron-LM``); fails instead under
``MEGATRON_PG_AGG_REQUIRE_SLIME=1`` (CI's 0.16.1 leg).
"""
from __future__ import annotations

import os

import pytest

from megatron_pg_agg.integrations.slime.plugin import CHECKOUT_ENV, checkout_problem
from tests.support.slime_family import GBS, MODES, SPLITS, checkout_paths, launch_layouts, stock_token_mean_moves

REQUIRE_SLIME = "MEGATRON_PG_AGG_REQUIRE_SLIME"
OBJECTIVE_TOL = 1e-6  # of max(|J|, 0.01)
GRAD_TOL = 1e-5  # relative, whole gradient


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """{layout: {case: result}} from one launch per world size (every case each)."""
    slime, megatron_lm = checkout_paths(CHECKOUT_ENV, checkout_problem, REQUIRE_SLIME)
    return launch_layouts(tmp_path_factory.mktemp("slime"), "slime", CHECKOUT_ENV, slime, megatron_lm)


def _errors(step: dict) -> tuple[float, float]:
    return abs(step["objective"] - step["reference"]) / max(abs(step["reference"]), 0.01), step["grad_error"]


def _exact(step: dict) -> bool:
    obj, grad = _errors(step)
    return obj <= OBJECTIVE_TOL and grad <= GRAD_TOL


def test_every_mode_split_and_layout_equals_the_float64_reference(results):
    """4 modes (constant with L = 12) x micro-batches static 1, static 3 and dynamic (a 30-token cap)
    x DP 1/2, CP 1/2, two optimizer steps each: J (slime's own logged train/loss) within 1e-6 of
    max(|J|, 0.01) of the float64 reference and the reduced gradient within 1e-5. The removed sample
    counts in the denominator (filtered numerator), the fully masked one nowhere. Catches D_i per
    micro-batch or rank, the numerator mask as the denominator, a step grouping that is not
    slime's (the reference groups the steps itself), gbs left out, the CP chunks' denominators."""
    worst = {}
    for layout, cases in results.items():
        for mode in MODES:
            for split in SPLITS:
                case = cases[f"{mode}-{split}"]
                assert len(case["steps"]) == 2, (layout, mode, split)
                for step in case["steps"]:
                    obj, grad = _errors(step)
                    assert obj <= OBJECTIVE_TOL and grad <= GRAD_TOL, (layout, mode, split, step)
                    assert step["increment"] == GBS  # slime's scheduler counted the step's rollouts
                    w = worst.setdefault(mode, [0.0, 0.0])
                    w[0], w[1] = max(w[0], obj), max(w[1], grad)
    print("slime worst per mode (objective, gradient): " + "; ".join(
        f"{m} {o:.1e} {g:.1e}" for m, (o, g) in worst.items()))


def test_the_micro_batch_splits_differ(results):
    """The splits are really different: micro-batches per rank and step (static 1 and 3 follow
    --micro-batch-size over the DP size; dynamic the token cap times CP)."""
    expected = {"dp1cp1": {"static1": [6, 6], "static3": [2, 2]}, "dp2cp1": {"static1": [3, 3], "static3": [1, 1]},
                "dp1cp2": {"static1": [6, 6], "static3": [2, 2]}}
    for layout, cases in results.items():
        for split, counts in expected[layout].items():
            assert cases[f"token_mean-{split}"]["num_microbatches"] == counts, (layout, split)
        dynamic = cases["token_mean-dynamic"]["num_microbatches"]
        assert dynamic not in expected[layout].values(), (layout, dynamic)


def test_control_slimes_stock_token_mean_moves_with_a_fully_masked_sample(results):
    """slime's own --calculate-per-token-loss, no plug-in: exact on the batch without a fully
    masked sample; with one (sample 4; sample 7 removed, which slime masks whole), each step's J
    and gradient are the reference's times N / (N + k), k the fully masked samples: clamp_min(M_i, 1)
    counts each as a token."""
    moved = stock_token_mean_moves(results, SPLITS, _exact)
    print(f"slime's stock token mean with one fully masked sample: J and gradient off by "
          f"{min(moved):.2%} to {max(moved):.2%}")


def test_a_denominator_below_one_is_refused_naming_the_samples(results):
    """constant with L = 1 (D_i = S*L/gbs = 5/6 in step 0, 6/6 in step 1): slime's conversion hook
    raises before anything trains, naming each sample of step 0 with its D_i and the clamp; L = 12
    (D_i = 10) trains exactly (the test above)."""
    for layout, cases in results.items():
        text = cases["refused-constant-L1"]["refused"]
        assert "clamp_min(D_i, 1)" in text, text
        for i in (0, 1, 2, 3, 5):
            assert f"sample {i} (Sample.index {i}, group_index {i // 3}) (step 0): D_i = 0.8333" in text, (layout, i)
        assert "sample 4 " not in text and "(step 1)" not in text, text  # inactive; step 1 has D_i = 1


def _critic_worst(results, prefix: str, check) -> dict:
    """{mode: [objective, gradient]} and {layout: [...]} worst errors over ``{prefix}{mode}-{split}``
    critic cases, every step passed to ``check(layout, mode, split, step)`` first."""
    per_mode, per_layout = {}, {}
    for layout, cases in results.items():
        for mode in MODES:
            for split in SPLITS:
                case = cases[f"{prefix}{mode}-{split}"]
                assert len(case["steps"]) == 2, (layout, mode, split)
                for step in case["steps"]:
                    check(layout, mode, split, step)
                    obj, grad = _errors(step)
                    for key, worst in ((mode, per_mode), (layout, per_layout)):
                        w = worst.setdefault(key, [0.0, 0.0])
                        w[0], w[1] = max(w[0], obj), max(w[1], grad)
    return {"mode": per_mode, "layout": per_layout}


def test_the_critic_follows_every_mode_split_and_layout(results):
    """slime's critic (--advantage-estimator ppo: its own train_critic, forward_only values, PPO GAE
    returns, value_loss_function through get_sum_of_sample_mean) on the rollout_mask_sums the
    plug-in's hook wrote: its value loss J_v = sum_t c_t n_t v_t / W, v_t = max((V-R)^2,
    (clip(V, V_old +- 0.2) - R)^2) (slime's factor 1), equals the float64 reference in every mode
    (constant L = 12), split and layout: J_v (slime's logged train/critic-value_loss) within 1e-6
    of max(|J_v|, 0.01), the reduced gradient within 1e-5. Step 0 trains at V = V_old (no clip);
    an SGD step in between puts step 1 partly in the clip. Catches the critic not reading the
    hook's denominators (slime's default per-sample mean is 17% off here: the control below), a
    value mode other than the policy's, and the value clip or the returns misread."""
    def check(layout, mode, split, step):
        obj, grad = _errors(step)
        assert obj <= OBJECTIVE_TOL and grad <= GRAD_TOL, (layout, mode, split, step)
        assert step["increment"] == GBS

    worst = _critic_worst(results, "critic-", check)
    for layout, cases in results.items():
        for mode in MODES:
            for split in SPLITS:
                first, second = cases[f"critic-{mode}-{split}"]["steps"]
                assert first["clipped"] == 0 and 0 < second["clipped"] < second["tokens"], (layout, mode, split)
    for key in ("mode", "layout"):
        print(f"slime critic worst per {key} (objective, gradient): " + "; ".join(
            f"{k} {o:.1e} {g:.1e}" for k, (o, g) in worst[key].items()))


def test_the_critics_micro_batch_splits_follow_the_flags(results):
    """The critic's static splits are --micro-batch-size over the DP size, as the actor's."""
    expected = {"dp1cp1": {"static1": [6, 6], "static3": [2, 2]}, "dp2cp1": {"static1": [3, 3], "static3": [1, 1]},
                "dp1cp2": {"static1": [6, 6], "static3": [2, 2]}}
    for layout, cases in results.items():
        for split, counts in expected[layout].items():
            assert cases[f"critic-token_mean-{split}"]["num_microbatches"] == counts, (layout, split)


def test_control_slimes_stock_value_loss_is_seq_mean_over_gbs(results):
    """slime's own value loss, the plug-in off (rollout_mask_sums = each sample's mask sum): exactly
    seq_mean when every sample of the step is active; with an inactive one per step (sample 4
    fully masked; sample 7 removed, which slime masks whole) J_v and its gradient are seq_mean's
    times S/gbs = 5/6: slime divides by --global-batch-size, which counts every sample."""
    moved = []
    for layout, cases in results.items():
        for split in SPLITS:
            for step in cases[f"stock-critic-clean-{split}"]["steps"]:
                obj, grad = _errors(step)
                assert step["active"] == GBS and obj <= OBJECTIVE_TOL and grad <= GRAD_TOL, (layout, split, step)
            for step in cases[f"stock-critic-{split}"]["steps"]:
                factor = step["active"] / GBS
                assert step["active"] == GBS - 1, step
                assert abs(step["objective"] - factor * step["reference"]) <= 1e-6 * abs(step["reference"]), step
                assert abs(step["grad_error"] - (1 - factor)) <= 1e-5, step
                moved.append(1 - factor)
    print(f"slime's stock value loss with one inactive sample per step: J_v and gradient off by {max(moved):.2%}")


def test_a_critic_role_overriding_the_global_batch_size_stays_exact(results):
    """--megatron-config-path giving the critic role global_batch_size 12: slime's loss divides by
    the step size the rollout manager's schedule carries (base --global-batch-size 6), so the
    override changes nothing the plug-in relies on (seq_mean, dynamic micro-batches)."""
    for layout, cases in results.items():
        for step in cases["critic-seq_mean-gbs-override"]["steps"]:
            obj, grad = _errors(step)
            assert obj <= OBJECTIVE_TOL and grad <= GRAD_TOL and step["increment"] == GBS, (layout, step)


def test_a_critic_role_turning_per_token_loss_on_is_refused_naming_the_flags(results):
    """--megatron-config-path giving the critic role calculate_per_token_loss: the hook refuses the
    rollout before anything trains, naming the YAML, the role and slime's flag."""
    for layout, cases in results.items():
        text = cases["refused-critic-per-token-loss"]["refused"]
        assert "--megatron-config-path" in text and "(critic overrides): --calculate-per-token-loss" in text, layout
        assert "(actor overrides)" not in text, (layout, text)


def test_the_skip_reason_names_the_variable_or_the_folder():
    """Without a checkout the reason names the variable; a folder that is not slime is named."""
    assert CHECKOUT_ENV in checkout_problem(None)
    assert "not a slime checkout" in checkout_problem(os.path.dirname(__file__))
