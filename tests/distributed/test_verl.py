"""The verl plug-in on verl 0.9.1's own Megatron engine, on CPU (issue 28).

verl builds its engine itself (``EngineRegistry.new(...).initialize()``: Megatron-Bridge loads a
tiny Qwen3 folder made by the project's command), and trains one mini-batch through its own
``forward_backward_batch`` and ``train_batch`` (Megatron DDP, verl's Megatron optimizer) with the
loss the plug-in sets on verl's actor worker. Expected values come from transformers' float64
model of the same folder and ``megatron_pg_agg.parity.step_objective`` (the README's formulas,
no package loss or aggregation code), never from the package's loss. See the worker's docstring
(``tests/distributed/workers/verl_checks.py``) for the batch. The critic (issue 46) runs in the same
launches: verl's engine with its value head, the loss verl's critic worker gets through the
plug-in, against the value term's float64 reference.

Python 3.12 with verl (the ``verl`` extra) only; elsewhere these tests skip with the reason, and
fail instead under MEGATRON_PG_AGG_REQUIRE_VERL=1 (.ci/run's 0.19.2 leg).
"""
import json
import sys

import pytest

from tests.support.launching import child_env, run, torchrun, worker
from tests.support.optional import REQUIRE_VERL, require

CHECKS = worker("verl_checks")
MODES = ("token_mean", "seq_mean", "prompt_mean", "constant")
OBJECTIVE_TOL = 1e-6  # |J| is 0.01..0.5: float32 sums over ~70 tokens against float64
GRAD_TOL = 1e-5  # relative, whole gradient: float32 model against float64 (seen: <= 6e-7)

pytestmark = pytest.mark.optional_stack  # .ci/run: after installing the stack


@pytest.fixture(scope="module", autouse=True)
def _verl_installed():
    from megatron_pg_agg.integrations.verl.config import verl_install_problem

    require(verl_install_problem(), REQUIRE_VERL)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl") / "qwen3"
    rc, log, _ = run([sys.executable, "-m", "megatron_pg_agg.integrations.bridge.tiny_hf", "--family", "qwen3",
                      "--seed", "3", str(out)], 120, "tiny qwen3", env=child_env())
    assert rc == 0, log[-5000:]
    return str(out)


@pytest.fixture(scope="module", params=[1, 2], ids=["DP1", "DP2"])
def checks(request, model, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"verl{request.param}") / "out.json"
    rc, log, elapsed = run(torchrun(request.param, *CHECKS, model, out), 900, f"verl engine DP{request.param}")
    assert rc == 0, log[-20000:]
    result = json.loads(out.read_text())
    print(f"verl DP{request.param}: {elapsed:.1f}s")
    return result


def test_every_mode_layout_and_split_equals_the_float64_reference(checks):
    """Each mode, padded and jagged, micro-batch sizes 1/2/4, dynamic batch size, with and without
    calculate_per_token_loss; the other policy losses, the corrections, the KL and entropy terms.
    A missing dp scale, a per-rank or per-micro-batch W, a group pooled on one rank only, a
    weight not travelling with its token through the dynamic re-ordering: each moves J or the
    gradient far beyond the tolerance (DP2 splits a prompt group across the ranks)."""
    cases = checks["cases"]
    for mode in MODES:
        mine = {(c["engine"], c["layout"], str(c["mbs"])) for c in cases if c.get("mode") == mode
                and "policy_loss" not in c and "correction" not in c and "kl" not in c["case"]}
        expected = {("thd", layout, mbs) for layout in ("padded", "jagged") for mbs in ("1", "2", "4")}
        expected |= {("thd", "jagged", "dynamic"), ("thd_per_token", "jagged", "1"), ("thd_per_token", "jagged", "4"),
                     ("thd_per_token", "jagged", "dynamic")}
        assert mine == expected, (mode, sorted(mine ^ expected))
    assert {c["policy_loss"] for c in cases if "policy_loss" in c} == {"gspo", "gmpo", "cispo"}
    assert {c["correction"] for c in cases if "correction" in c} == {"token_truncate", "sequence_mask", "verl_is"}
    bad = [c for c in cases if not (c["objective_error"] <= OBJECTIVE_TOL and c["grad_rel_error"] <= GRAD_TOL)]
    assert not bad, bad
    worst = max(cases, key=lambda c: c["grad_rel_error"])
    print(f"DP{checks['world']}: {len(cases)} cases; max |J - J_ref| "
          f"{max(c['objective_error'] for c in cases):.1e}; "
          f"max grad rel {worst['grad_rel_error']:.1e} ({worst['case']})")


def test_control_verl_own_seq_norm_moves_with_the_split_ours_does_not(checks):
    """verl's own seq-mean-token-sum-norm (loss_scale_factor unset) divides by the longest response
    of each micro-batch: its objective changes with the micro-batch size; ours (constant, L fixed)
    gives one value at every size. verl's token-mean equals our token_mean, value and gradient."""
    control = checks["control"]
    norm = {c["mbs"]: c["objective"] for c in control if c["verl_loss_agg_mode"] == "seq-mean-token-sum-norm"}
    assert set(norm) == {1, 2, 4}
    assert max(norm.values()) - min(norm.values()) > 1e-2, norm
    ours = [c["objective"] for c in checks["cases"] if c.get("mode") == "constant" and "policy_loss" not in c]
    assert max(ours) - min(ours) <= 2 * OBJECTIVE_TOL, ours
    token = [c for c in control if c["verl_loss_agg_mode"] == "token-mean"]
    ours_token = next(c for c in checks["cases"] if c.get("mode") == "token_mean")
    for c in token:
        assert abs(c["objective"] - ours_token["reference"]) <= OBJECTIVE_TOL, c
        assert c["grad_rel_error"] <= GRAD_TOL, c
    print(f"DP{checks['world']}: verl seq-mean-token-sum-norm at mbs 1/2/4: "
          + " / ".join(f"{norm[m]:.4f}" for m in (1, 2, 4)) + f"; ours constant: {ours[0]:.6f} at every split")


def test_train_batch_steps_with_the_reference_gradient_norm(checks):
    """verl's train_batch (zero_grad, forward-backward, its Megatron optimizer): the grad norm it
    reports equals the reference's, and the weights moved."""
    for step in checks["train_batch"]:
        assert step["grad_norm"] is not None, step
        assert abs(step["grad_norm"] - step["grad_norm_reference"]) <= GRAD_TOL * step["grad_norm_reference"], step
        assert step["weights_moved"] > 1e-4, step


CRITIC_SPLITS = {("thd", "2"), ("thd", "1"), ("thd", "dynamic"), ("thd_per_token", "4")}


def test_critic_every_mode_and_split_equals_the_float64_reference(checks):
    """verl's critic engine (value head) with the loss verl's critic worker gets through the plug-in
    (critic.loss_agg_mode = the mode): every mode, padded mbs 2, jagged mbs 1, verl's dynamic split
    (what 0.9.1's critic runs whatever critic.use_dynamic_bsz says, verl #7462), per-token loss at
    mbs 4; objective to 1e-6 of max(|J|, 0.01), whole gradient (value head included) to 1e-5,
    with the clip active on some tokens and not others. A per-micro-batch or per-rank W^v, verl's
    token count where the mode's W^v belongs, V taken at the response token instead of the one
    before it, the clip around R, a missing 0.5 or dp scale: each moves J_v or its gradient far
    beyond the tolerance (DP2 cuts a prompt group across the ranks)."""
    cases = checks["critic"]
    for mode in MODES:
        mine = {(c["engine"], str(c["split"])) for c in cases if c["mode"] == mode}
        assert mine == CRITIC_SPLITS, (mode, sorted(mine ^ CRITIC_SPLITS))
    bad = [c for c in cases if not (c["objective_error"] <= OBJECTIVE_TOL and c["grad_rel_error"] <= GRAD_TOL)]
    assert not bad, bad
    assert all(0.05 < c["clip_fraction"] < 0.95 for c in cases), [c["clip_fraction"] for c in cases]
    for mode in MODES:
        mine = [c for c in cases if c["mode"] == mode]
        worst_j, worst_grad = max(c["objective_error"] for c in mine), max(c["grad_rel_error"] for c in mine)
        print(f"DP{checks['world']} critic {mode}: J_v {mine[0]['reference']:.8f}; max rel |J_v - J_ref| "
              f"{worst_j:.1e}; max grad rel {worst_grad:.1e}")


def test_critic_control_verl_token_mean_equals_ours_its_norm_mode_moves_with_the_split(checks):
    """verl's own value_loss (plug-in off) on the same critic engine and batch: token-mean equals our
    token_mean at every split (value and gradient); seq-mean-token-sum-norm without
    loss_scale_factor divides by each micro-batch's longest response and moves with the split (the
    plug-in refuses it without L), while our constant gives one value at every split."""
    control = checks["critic_control"]
    token = [c for c in control if c["verl_loss_agg_mode"] == "token-mean"]
    assert {str(c["split"]) for c in token} == {"1", "4", "dynamic"}
    for c in token:
        assert abs(c["objective"] - c["reference"]) <= OBJECTIVE_TOL * max(abs(c["reference"]), 0.01), c
        assert c["grad_rel_error"] <= GRAD_TOL, c
    norm = {c["split"]: c["objective"] for c in control if c["verl_loss_agg_mode"] == "seq-mean-token-sum-norm"}
    assert set(norm) == {1, 2, 4} and max(norm.values()) - min(norm.values()) > 1e-2, norm
    ours = [c["objective"] for c in checks["critic"] if c["mode"] == "constant"]
    assert max(ours) - min(ours) <= 2 * OBJECTIVE_TOL, ours
    print(f"DP{checks['world']}: verl critic seq-mean-token-sum-norm at mbs 1/2/4: "
          + " / ".join(f"{norm[m]:.4f}" for m in (1, 2, 4)) + f"; ours constant: {ours[0]:.6f} at every split")


def test_critic_train_batch_steps_with_the_reference_gradient_norm(checks):
    step = checks["critic_train_batch"]
    assert step["grad_norm"] is not None, step
    assert abs(step["grad_norm"] - step["grad_norm_reference"]) <= GRAD_TOL * step["grad_norm_reference"], step
    assert step["weights_moved"] > 1e-4, step
