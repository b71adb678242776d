"""The parity suite: the real megatron-core schedules, DDP and finalize_model_grads under several
layouts (torchrun, gloo, CPU) against a single-process reference, for every mode and policy loss.

One run of the parity command (two torchrun launches: 2 and 4 ranks) covers DP=2, TP=2, PP=2
(1F1B), PP=2 interleaved, 1/3/8 microbatches, DP=2 x PP=2, TP=2 x PP=2, TP=2 x DP=2, CP=2 x DP=2
(per-token model), the MoE layouts, each with ppo, gspo, gmpo and cispo, and four negative controls
that must FAIL parity (one: GSPO's sequence statistic without the CP all-reduce). The
reference (``parity.step_objective``) shares no code with the package's loss or aggregation, so a
bug common to the library's two forms fails every row. The table in docs/parity.md must be what
this run prints (benchmarks/parity_table.py writes it). Host-only checks of the reference and the
command are in tests/unit/parity/test_parity_reference.py.
"""
import json
import subprocess
import sys

import pytest

from megatron_pg_agg.parity import DEFAULT_CASES, GRAD_RTOL, MODES, OBJECTIVE_RTOL, POLICY_LOSSES, find_markdown_table
from megatron_pg_agg.patches import mtp_loss
from megatron_pg_agg.versions import in_range, installed_megatron_core_version
from tests.support.launching import ROOT, launcher_env
from tests.support.parity_tables import table_mismatches


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    out, png = tmp / "rows.json", tmp / "errors.png"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_pg_agg.parity", "--json", str(out), "--plot", str(png),
         "--timeout", "600"],
        cwd=ROOT, capture_output=True, text=True, timeout=1300, env=launcher_env(),
    )
    return proc, out, png


def test_every_layout_and_mode_matches_the_reference(parity_run):
    proc, out, _ = parity_run
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-20000:]
    rows = json.loads(out.read_text())
    checked = [r for r in rows if not r["layout"].startswith("single") and not r["expect_fail"]]
    mtp_release = in_range(installed_megatron_core_version(), mtp_loss.SUPPORTED)
    expected = {(case.name, p, m) for case in DEFAULT_CASES if not case.expect_fail and (mtp_release or not case.mtp)
                for p, m in case.runs(MODES, POLICY_LOSSES)}
    assert any(case.mtp for case in DEFAULT_CASES) and all(p == "ppo" for n, p, _ in expected if n.startswith("MTP"))
    assert {(r["layout"], r["policy_loss"], r["mode"]) for r in checked} == expected
    for r in checked:
        assert r["objective_rel_err"] <= OBJECTIVE_RTOL, r
        assert r["grad_max_rel_err"] <= GRAD_RTOL, r
        assert r["passed"]
    # the summary line exactly (a substring match would accept "10 failed")
    assert proc.stdout.rstrip().splitlines()[-1] == f"{len(rows)} passed, 0 failed", proc.stdout[-3000:]


def test_negative_controls_fail_parity(parity_run):
    """Megatron's default averaging with unequal microbatches, weights computed per microbatch
    (prompt_mean across microbatches; seq_mean across CP shards) and GSPO's sequence ratio from
    each CP rank's own tokens (no CP all-reduce) must be caught."""
    proc, out, _ = parity_run
    rows = json.loads(out.read_text())
    controls = [r for r in rows if r["expect_fail"]]
    assert {(r["layout"], r["policy_loss"]) for r in controls} == {
        (case.name, p) for case in DEFAULT_CASES if case.expect_fail for p in case.control_policy_losses}
    assert ("gspo", 2) in {(r["policy_loss"], c.cp) for r in controls for c in DEFAULT_CASES if c.name == r["layout"]}
    for r in controls:
        assert r["grad_max_rel_err"] > 100 * GRAD_RTOL, r  # far outside the tolerance, not noise
        assert r["passed"]  # "passed" for a control means: parity failed, as it must


def test_plot_is_written(parity_run):
    _, _, png = parity_run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_docs_parity_table_is_what_the_suite_prints(parity_run):
    """docs/parity.md's table (written by benchmarks/parity_table.py from --json) against this
    run."""
    _, out, _ = parity_run
    rows = json.loads(out.read_text())
    text = (ROOT / "docs" / "parity.md").read_text()
    start, end = find_markdown_table(text)
    problems = table_mismatches(text[start:end], rows)
    assert not problems, "docs/parity.md parity table is stale (python benchmarks/parity_table.py " \
                         "parity.json --doc docs/parity.md):\n" + "\n".join(problems)
