"""The parity suite: the real megatron-core schedules, DDP and finalize_model_grads under several
layouts (torchrun, gloo, CPU) against a single-process reference, for every mode.

One run of the parity command (two torchrun launches: 2 and 4 ranks) covers DP=2, TP=2, PP=2
(1F1B), PP=2 interleaved, 1/3/8 microbatches, DP=2 x PP=2, TP=2 x PP=2, TP=2 x DP=2, CP=2 x DP=2
(per-token model) and three negative controls that must FAIL parity.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pg_agg.parity import DEFAULT_LAYOUTS, GRAD_RTOL, MODES, OBJECTIVE_RTOL, loss_config, parity_rollouts
from megatron_pg_agg.planner import PlanConfig, plan_step

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    out, png = tmp / "rows.json", tmp / "errors.png"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_pg_agg.parity", "--json", str(out), "--plot", str(png),
         "--timeout", "600"],
        cwd=ROOT, capture_output=True, text=True, timeout=1300,
    )
    return proc, out, png


def test_every_layout_and_mode_matches_the_reference(parity_run):
    proc, out, _ = parity_run
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-20000:]
    rows = json.loads(out.read_text())
    checked = [r for r in rows if not r["layout"].startswith("single") and not r["expect_fail"]]
    expected = {(lay.name, m) for lay in DEFAULT_LAYOUTS if not lay.expect_fail for m in MODES}
    assert {(r["layout"], r["mode"]) for r in checked} == expected
    for r in checked:
        assert r["objective_rel_err"] <= OBJECTIVE_RTOL, r
        assert r["grad_max_rel_err"] <= GRAD_RTOL, r
        assert r["passed"]
    assert "0 failed" in proc.stdout


def test_negative_controls_fail_parity(parity_run):
    """Megatron's default averaging with unequal microbatches, and weights computed per
    microbatch (prompt_mean across microbatches; seq_mean across CP shards) must be caught."""
    proc, out, _ = parity_run
    rows = json.loads(out.read_text())
    controls = [r for r in rows if r["expect_fail"]]
    assert {r["layout"] for r in controls} == {lay.name for lay in DEFAULT_LAYOUTS if lay.expect_fail}
    for r in controls:
        assert r["grad_max_rel_err"] > 100 * GRAD_RTOL, r  # far outside the tolerance, not noise
        assert r["passed"]  # "passed" for a control means: parity failed, as it must


def test_plot_is_written(parity_run):
    _, _, png = parity_run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_parity_step_really_splits_groups_and_has_unequal_microbatches():
    rollouts = parity_rollouts()
    plan = plan_step(rollouts, loss_config("prompt_mean"), PlanConfig(dp_size=2, num_microbatches=3))
    where = {}
    for rank, mbs in enumerate(plan.microbatches):
        for m, mb in enumerate(mbs):
            for s in mb.sequence_ids:
                where.setdefault(rollouts[s].group_id, set()).add((rank, m))
    assert any(len({r for r, _ in v}) > 1 for v in where.values()), "no group spans two DP ranks"
    assert any(len({m for r, m in v if r == rank}) > 1 for v in where.values() for rank in (0, 1)), \
        "no group spans two microbatches of one DP rank"
    counts = [int(mb.weights.count.sum()) for mbs in plan.microbatches for mb in mbs]
    tokens = [t for row in plan.bin_tokens for t in row]
    assert len(set(counts)) > 1 and len(set(tokens)) > 1
    # one response has no valid token and some tokens are filtered from the numerator only
    assert any(sum(r.loss_mask) == 0 for r in rollouts)
    assert any(n < m for r in rollouts for n, m in zip(r.numerator_mask, r.loss_mask))
