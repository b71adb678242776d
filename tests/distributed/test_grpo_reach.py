"""Online GRPO on the reach task (launch/grpo_reach.py), the quick setting, under torchrun (DP=2).

One launch: ``--quick`` (seed 0; GRPO = seq_mean + std and Dr. GRPO = constant without std; 60
RL steps each from the same warm-up) with the on-policy check every 10th step. It checks:

* **on-policy sampling**: at every checked step the behaviour log-probs the sampler recorded equal
  the trainer's log-probs of the same tokens under the same weights (a forward-only pass over the
  packed THD microbatches the first update trains on) to float tolerance, and the same pass after
  the step's updates is far from them (the check sees a moved policy); the first update's PPO
  ratio is 1;
* **the same start**: step 0 of both variants is the same checkpoint, prompts and samples;
* **learning**: accuracy rises under both objectives;
* **complete records**, the summary table and the plot;
* **refusals** before any process group: a user's folder as ``--out``, and TP > 1.

The length bias itself is measured by the full comparison (docs/length-bias.md). Over 5 seeds the
quick setting's last-quarter ratio of incorrect-response lengths (GRPO over Dr. GRPO) was 1.30 to
1.53, and the accuracies differed by up to 0.062: not far enough from the issue's 1.5x / 0.05
threshold to assert it here (a sample drawn differently through float noise moves a run within
that spread). What is asserted is the direction, GRPO's incorrect responses longer than Dr.
GRPO's by more than 10%, which held with a wide margin in all 5 seeds.
"""
from __future__ import annotations

import json
import math
import os
import sys

import pytest

from tests.support.launching import ROOT, run, torchrun

ENTRY = ROOT / "launch" / "grpo_reach.py"
TIMEOUT_S = 400  # 100-170 s on 2 cores (the slower beside other jobs)
STEPS = 60
KEYS = ("step", "seed", "variant", "accuracy", "length_correct", "length_incorrect", "truncated", "objective",
        "grad_norm", "ratio_first", "sample_s", "step_s")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("reach") / "quick"
    rc, log, seconds = run(torchrun(2, ENTRY, "--quick", "--check-on-policy-every", "10", "--out", out),
                           TIMEOUT_S, "grpo_reach --quick")
    if rc != 0:
        pytest.fail(f"grpo_reach --quick exited {rc}:\n{log[-20000:]}")
    with open(out / "steps.jsonl") as f:
        records = [json.loads(line) for line in f]
    print(f"grpo_reach --quick: {seconds:.0f} s")
    return out, records, log


def _runs(records):
    runs = {}
    for r in records:
        runs.setdefault(r["variant"], []).append(r)
    return runs


def test_every_record_is_complete(quick):
    out, records, log = quick
    runs = _runs(records)
    assert sorted(runs) == ["dr_grpo", "grpo"]
    for name, steps in runs.items():
        assert [r["step"] for r in steps] == list(range(STEPS)), name
        for r in steps:
            missing = [k for k in KEYS if k not in r]
            assert not missing, (name, r["step"], missing)
            for k in ("accuracy", "truncated", "objective", "grad_norm", "ratio_first"):
                assert math.isfinite(r[k]), (name, r["step"], k)
            assert r["responses"] == 32 * 8
    assert (out / "summary.md").read_text().count("\n| ") == 2
    assert (out / "length_bias.png").stat().st_size > 10_000
    assert "done: " in log


def test_sampling_is_on_policy(quick):
    _, records, _ = quick
    checked = [r for r in records if "on_policy_error" in r]
    assert len(checked) == 2 * STEPS // 10
    worst = max(r["on_policy_error"] for r in checked)
    # float32 log-softmax of the same network on the same prefix, [B, t] with a causal mask vs packed
    # THD: measured at most ~2e-6
    assert worst < 1e-4, worst
    # the control: after the step's two updates the same tokens' log-probs have moved by far more
    assert min(r["moved_error"] for r in checked) > 100 * max(worst, 1e-7)
    # the first update's PPO ratio (the loss provider's own report) is 1 at the sampling weights
    assert max(abs(r["ratio_first"] - 1) for r in records) < 1e-5


def test_both_variants_start_from_the_same_checkpoint_and_prompts(quick):
    _, records, _ = quick
    first = {r["variant"]: r for r in records if r["step"] == 0}
    for key in ("accuracy", "length_correct", "length_incorrect", "truncated"):
        assert first["grpo"][key] == first["dr_grpo"][key], key


def test_accuracy_rises_under_both_objectives(quick):
    _, records, _ = quick
    for name, steps in _runs(records).items():
        quarter = STEPS // 4
        start = sum(r["accuracy"] for r in steps[:quarter]) / quarter
        end = sum(r["accuracy"] for r in steps[-quarter:]) / quarter
        # warm start ~0.25-0.35; measured 0.7-0.9 after 60 steps over 5 seeds
        assert end > start + 0.25, (name, start, end)


def test_refusals_before_any_process_group(tmp_path):
    users = tmp_path / "mine"
    users.mkdir()
    (users / "notes.txt").write_text("keep me")
    cmd = [sys.executable, str(ENTRY), "--out", str(users), "--quick"]
    rc, log, _ = run(cmd, 120, "grpo_reach refusal")
    assert rc == 2, log
    assert "--out" in log and str(users) in log
    assert (users / "notes.txt").read_text() == "keep me" and os.listdir(users) == ["notes.txt"]
    rc, log, _ = run([sys.executable, str(ENTRY), "--out", str(tmp_path / "new"), "--tensor-model-parallel-size",
                      "2"], 120, "grpo_reach TP refusal")
    assert rc == 2 and "--tensor-model-parallel-size=2" in log, log
    assert not (tmp_path / "new").exists()


def test_grpo_lengthens_incorrect_responses_more_than_dr_grpo(quick):
    _, records, _ = quick
    quarter = STEPS // 4

    def last_quarter(name):
        values = [r["length_incorrect"] for r in _runs(records)[name][-quarter:]]
        values = [v for v in values if not math.isnan(v)]
        return sum(values) / len(values)

    # measured 1.30-1.53 over seeds 0-4 (seed 0: 1.34); a wrong aggregation (both runs the same mode)
    # gives about 1.0
    assert last_quarter("grpo") > 1.1 * last_quarter("dr_grpo")
