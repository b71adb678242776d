"""The AReaL plug-in on AReaL 1.0.4's own Megatron actor (CPU, gloo, torchrun DP 1 and 2).

tests/distributed/workers/areal_checks.py builds the plug-in's actor through AReaL's own
initialisation (mbridge from a tiny Qwen3 made by tiny_hf, the distributed optimizer, float32) and
runs AReaL's ``compute_advantages`` + ``ppo_update`` under every case; the reference is transformers'
float64 model of the same folder with ``megatron_pg_agg.parity.step_objective`` (the README's
formulas, no package loss or aggregation code) and autograd, per optimizer step. The same launches
then build the plug-in's critic (AReaL's ``MegatronPPOCritic``, its value head random) and run
AReaL's ``compute_values`` + ``ppo_update`` under every case, against transformers' float64 trunk
times the critic's value head with AReaL's clipped squared error and the mode's formula written in
the worker; and the actor's cases with AReaL's distillation term (``teacher_logp``). Needs AReaL's
stack (docs/areal.md: Python 3.12, its own venv); skips without it, fails in CI
(MEGATRON_PG_AGG_REQUIRE_AREAL=1).
"""
from __future__ import annotations

import json
import math
import sys

import pytest

from tests.support.launching import child_env, run, torchrun, worker
from tests.support.optional import REQUIRE_AREAL, require

CHECKS = worker("areal_checks")
OBJECTIVE_TOL = 1e-6  # of max(|J|, 0.01)
GRAD_TOL = 1e-5  # relative, whole gradient
MODES = ("token_mean", "seq_mean", "prompt_mean", "constant")
SPLITS = ("1mb", "3mb", "cap30")

pytestmark = pytest.mark.optional_stack


@pytest.fixture(scope="module", autouse=True)
def _areal_installed():
    from megatron_pg_agg.integrations.areal.actor_patch import areal_problem

    require(areal_problem(), REQUIRE_AREAL)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """{dp: the worker's output} for DP 1 and 2 (one launch each, every case)."""
    tmp = tmp_path_factory.mktemp("areal")
    model = tmp / "qwen3"
    rc, log, _ = run([sys.executable, "-m", "tests.distributed.workers.areal_worker", "--make-model", str(model)],
                     300, "tiny qwen3 + tokenizer", env=child_env())
    assert rc == 0, log[-5000:]
    out = {}
    for dp in (1, 2):
        path = tmp / f"dp{dp}.json"
        rc, log, elapsed = run(torchrun(dp, *CHECKS, model, path), 900, f"AReaL checks DP{dp}")
        assert rc == 0, log[-20000:]
        out[dp] = json.loads(path.read_text())
        print(f"AReaL DP{dp}: {len(out[dp]['cases'])} cases in {elapsed:.1f}s (ready after "
              f"{out[dp]['times']['ready']:.1f}s)")
    return out


def _rel(a, b) -> float:
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    return diff / max(math.sqrt(sum(y * y for y in b)), 1e-30)


def _assert_reference(case: dict, name: str) -> tuple:
    worst = (0.0, 0.0)
    for step in case["steps"]:
        obj_err = abs(step["objective"] - step["reference"]) / max(abs(step["reference"]), 0.01)
        assert obj_err <= OBJECTIVE_TOL and step["grad_error"] <= GRAD_TOL, (name, step)
        worst = (max(worst[0], obj_err), max(worst[1], step["grad_error"]))
    return worst


def test_every_mode_split_and_step_count_equals_the_float64_reference(results):
    """4 modes (constant with L = 12) x 3 micro-batch splits (1, 3, a 30-token cap) x
    ppo_n_minibatches 1 and 2, at DP 1 and 2: each optimizer step's J within 1e-6 of max(|J|, 0.01)
    of the float64 reference and the whole gradient within 1e-5. With 2 steps, every prompt group
    lies in exactly one step (AReaL's own split cuts 2 of 4). Catches a per-micro-batch or per-rank
    W, a c_t not travelling with its token through AReaL's packing, n_i/w_i or D/W dropped, a group
    cut across steps (its T_g would then be split), or the DP weights not gathered."""
    worst = {}
    for dp, result in results.items():
        for mode in MODES:
            for split in SPLITS:
                for steps in (1, 2):
                    name = f"{mode}-{split}-steps{steps}"
                    case = result["cases"][name]
                    assert len(case["steps"]) == steps, (dp, name)
                    groups = [g for s in case["steps"] for g in s["groups"]]
                    assert sorted(groups) == [0, 1, 2, 3], (dp, name, groups)  # whole, once each
                    obj, grad = _assert_reference(case, name)
                    w = worst.setdefault(mode, [0.0, 0.0])
                    w[0], w[1] = max(w[0], obj), max(w[1], grad)
    print("AReaL worst per mode (objective, gradient): " + "; ".join(
        f"{m} {o:.1e} {g:.1e}" for m, (o, g) in worst.items()))


def test_controls_stock_token_mean_unchanged_and_the_naive_swap_moves(results):
    """The plug-in off (AReaL's own update on the same actor): token mean, equal to the reference
    under every split. AReaL's loss alone swapped for a micro-batch seq-mean (its token weight
    kept) equals the seq-mean with one micro-batch and misses it by far with several."""
    for dp, result in results.items():
        for split in SPLITS:
            _assert_reference(result["cases"][f"stock-{split}"], f"stock-{split}")
        naive = {split: result["cases"][f"naive-seq-{split}"]["steps"][0] for split in SPLITS}
        assert naive["1mb"]["grad_error"] <= GRAD_TOL or dp > 1, naive["1mb"]
        assert min(naive["3mb"]["grad_error"], naive["cap30"]["grad_error"]) > 1e-2, naive
    print("naive seq-mean gradient error: " + "; ".join(
        f"DP{dp} {s} {r['cases'][f'naive-seq-{s}']['steps'][0]['grad_error']:.1e}"
        for dp, r in results.items() for s in SPLITS))


def test_clip_variants_dual_clip_and_gspo_equal_the_reference(results):
    """AReaL's dual clip (c_clip 1.1, binding on part of the batch) and GSPO (sequence-level
    ratio), plug-in seq_mean, under two splits and DP 1 and 2."""
    for result in results.values():
        for loss in ("dual_clip", "gspo"):
            for split in ("1mb", "3mb"):
                _assert_reference(result["cases"][f"{loss}-seq_mean-{split}"], loss)
    plain = results[1]["cases"]["seq_mean-1mb-steps1"]["steps"][0]["objective"]
    assert abs(results[1]["cases"]["dual_clip-seq_mean-1mb"]["steps"][0]["objective"] - plain) > 1e-3  # it binds


def _grad(result, name) -> list:
    (step,) = result["cases"][name]["steps"]
    return step["grad"]


def test_decoupled_sapo_and_m2po_do_not_depend_on_the_split_or_dp(results):
    """No float64 formula here for AReaL's decoupled loss and SAPO, and M2PO's selection is
    AReaL's (exact against the formula in tests/unit/integrations/test_areal_loss.py): their
    gradients under the plug-in are the same under every split and at DP 1 and 2 (1e-5). Catches
    the M2PO selection made per micro-batch or per rank."""
    names = [f"{loss}-prompt_mean" for loss in ("decoupled", "sapo")] + [f"m2po-{m}" for m in
                                                                        ("token_mean", "prompt_mean")]
    for name in names:
        base = _grad(results[1], f"{name}-1mb")
        for dp, result in results.items():
            for split in SPLITS:
                assert _rel(_grad(result, f"{name}-{split}"), base) <= GRAD_TOL, (name, dp, split)


def test_control_areals_own_m2po_moves_with_the_split(results):
    """AReaL's stock M2PO (mask chosen per micro-batch, divided by the kept count; issue #1730):
    the same batch's gradient changes with the split alone."""
    moved = []
    for result in results.values():
        base = _grad(result, "m2po-stock-1mb")
        moved += [_rel(_grad(result, f"m2po-stock-{split}"), base) for split in ("3mb", "cap30")]
    assert min(moved) > 1e-2, moved
    print(f"AReaL's stock M2PO: the split moves the gradient by {min(moved):.1%} to {max(moved):.1%}")


def test_the_response_group_baseline_reaches_the_engine(results):
    """group_baseline=response_mean: in every group the responses' mean advantages average to 0,
    each response counted once (AReaL's own centring is token-weighted); with the std, their
    spread is 1 (GRPO's unbiased std); both still equal the reference (3 micro-batches, DP 1 and 2).
    Catches the baseline not swapped in, or fed another batch's group sizes."""
    for dp, result in results.items():
        for baseline in ("response_mean", "response_mean_std"):
            case = result["cases"][f"baseline-{baseline}"]
            _assert_reference(case, baseline)
            for means in case["response_means"]:
                centre = sum(means) / len(means)
                assert abs(centre) <= 1e-6, (dp, baseline, means)
                if baseline == "response_mean_std":
                    spread = math.sqrt(sum((m - centre) ** 2 for m in means) / (len(means) - 1))
                    assert abs(spread - 1) <= 1e-4, (dp, means)


def test_the_critic_in_every_mode_split_and_step_count_equals_the_float64_reference(results):
    """AReaL's critic through the plug-in: 4 modes x 3 micro-batch splits x critic.ppo_n_minibatches
    1 and 2, at DP 1 and 2: each optimizer step's J_v within 1e-6 of max(|J_v|, 0.01) of the float64
    reference (trunk and value head) and the whole gradient, value head included, within 1e-5; every
    group in exactly one step; the value clip binding on some tokens and not all. Catches the value
    loss weighted by AReaL's token count instead of c^v_t, W^v per micro-batch or per rank, the clip
    not AReaL's, critic steps cutting groups (AReaL's own split), or the value head left out of DDP
    (its gradient would not be reduced over DP)."""
    worst = {}
    for dp, result in results.items():
        for mode in MODES:
            for split in SPLITS:
                for steps in (1, 2):
                    name = f"critic-{mode}-{split}-steps{steps}"
                    case = result["cases"][name]
                    assert len(case["steps"]) == steps, (dp, name)
                    assert sorted(g for s in case["steps"] for g in s["groups"]) == [0, 1, 2, 3], (dp, name)
                    assert all(0 < s["clipped"] for s in case["steps"]), (dp, name)
                    obj, grad = _assert_reference(case, name)
                    w = worst.setdefault(mode, [0.0, 0.0])
                    w[0], w[1] = max(w[0], obj), max(w[1], grad)
    print("AReaL critic worst per mode (objective, gradient): " + "; ".join(
        f"{m} {o:.1e} {g:.1e}" for m, (o, g) in worst.items()))


def test_control_areals_stock_critic_is_the_plugins_token_mean(results):
    """The plug-in off on the same critic (AReaL's own split, loss and weight): the token mean of
    the reference under every split, and the plug-in's token_mean step for step (1e-6); the value
    mode's own setting is read (policy prompt_mean, value_mode seq_mean: the seq_mean objective)."""
    for dp, result in results.items():
        cases = result["cases"]
        for split in SPLITS:
            _assert_reference(cases[f"critic-stock-{split}"], f"critic-stock-{split}")
            (stock,) = cases[f"critic-stock-{split}"]["steps"]
            (ours,) = cases[f"critic-token_mean-{split}-steps1"]["steps"]
            assert abs(stock["objective"] - ours["objective"]) <= OBJECTIVE_TOL * max(abs(ours["objective"]), 0.01)
        (other,) = cases["critic-prompt_mean-value_mode-seq_mean"]["steps"]
        _assert_reference(cases["critic-prompt_mean-value_mode-seq_mean"], "value_mode")
        (seq,) = cases["critic-seq_mean-3mb-steps1"]["steps"]
        (prompt,) = cases["critic-prompt_mean-3mb-steps1"]["steps"]
        assert abs(other["objective"] - seq["objective"]) <= OBJECTIVE_TOL * abs(seq["objective"]), dp
        assert abs(seq["objective"] - prompt["objective"]) > 1e-3 * abs(seq["objective"]), dp  # they differ here


def test_the_critics_value_head_trains_and_stays_one_over_dp(results):
    """One real optimizer step of the plug-in's critic: the value head moves (AReaL 1.0.4 alone puts
    it in after DDP's buffers are built: with this untied model its distributed optimizer fails at
    start-up; with a tied one the head never moves), the trunk too, and the head is the same on
    every DP rank after (built before DDP, it is broadcast and its gradient reduced)."""
    for dp, result in results.items():
        info = result["critic"]
        assert info["head_moved"] > 1e-4 and info["trunk_moved"] > 1e-4, (dp, info)
        assert info["head_spread"] == 0.0, (dp, info)


def test_distillation_through_the_plugin_equals_the_float64_reference(results):
    """AReaL's KD term (teacher_logp) through the plug-in, at DP 1 and 2 under every split: joint
    (rl_loss_weight 0.7 x prompt_mean's J_pg + distill_loss_weight 0.3 x the KD token mean over the
    step's valid tokens) and pure KD (rl_loss_weight 0: the KD token mean alone) equal the float64
    reference, also over 2 optimizer steps; AReaL's own joint KD (plug-in off, token mean, no M2PO)
    too; with M2PO choosing the PG numerator, the gradient is the same under every split and DP
    (1e-5). Catches the KD term divided per micro-batch by M2PO's kept count, weighted by the PG
    mode, rl_loss_weight lost, or the KD term refused (as it was)."""
    worst = {}
    for result in results.values():
        cases = result["cases"]
        for kind in ("joint-prompt_mean", "pure-seq_mean"):
            for split in SPLITS:
                obj, grad = _assert_reference(cases[f"kd-{kind}-{split}"], f"kd-{kind}-{split}")
                w = worst.setdefault(kind.split("-")[0], [0.0, 0.0])
                w[0], w[1] = max(w[0], obj), max(w[1], grad)
        _assert_reference(cases["kd-joint-prompt_mean-3mb-steps2"], "kd steps2")
        _assert_reference(cases["kd-stock-joint-3mb"], "kd stock")
    base = _grad(results[1], "kd-joint-m2po-prompt_mean-1mb")
    for dp, result in results.items():
        for split in SPLITS:
            assert _rel(_grad(result, f"kd-joint-m2po-prompt_mean-{split}"), base) <= GRAD_TOL, (dp, split)
    print("AReaL KD worst (objective, gradient): " + "; ".join(f"{k} {o:.1e} {g:.1e}" for k, (o, g) in worst.items()))
