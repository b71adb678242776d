"""benchmarks/gpu_e2e.py --dry-run: every check of the GPU end-to-end script, on CPU (gloo) at tiny sizes,
through the same code paths as the GPU run (``--bf16 --use-distributed-optimizer --overlap-grad-reduce``,
the local spec), so a path broken here cannot first show on the GPU machine.

One launch of the script (its checks are processes of their own: torchrun with one rank each) against
the Megatron-LM checkout the other Megatron-LM tests use. The RL-loop part of check c needs
megatron-core 0.19 and is skipped by the script, with its reason, on older releases (as the project's
RL tests skip); everything else runs on every leg. Each test reads one check's numbers and holds
them to what that check must show. Measured on 2 cores: see docs/performance.md, "GPU end-to-end
script".
"""
from __future__ import annotations

import json
import math
import sys

import pytest

from megatron_pg_agg.core.modes import MODES
from megatron_pg_agg.versions import in_range, installed_megatron_core_version
from tests.support.launching import ROOT, launcher_env, run

SCRIPT = ROOT / "benchmarks" / "gpu_e2e.py"
RL_RELEASE = in_range(installed_megatron_core_version(), ">=0.19,<0.20")
TIMEOUT_S = 900
SPLIT_OBJECTIVE = 1e-5
"""bf16 objective spread over the 3 splits (test_production_config.py's bound: a sequence's tokens
are computed the same way in any microbatch)."""
SPLIT_GRAD_NORM = 1e-2
"""bf16 gradient-norm spread over the 3 splits (each microbatch's gradient is rounded to bf16 before
the fp32 main gradient adds it)."""


@pytest.fixture(scope="module")
def report(tmp_path_factory, megatron_lm_checkout):
    tmp = tmp_path_factory.mktemp("gpu_e2e")
    out = tmp / "report.json"
    cmd = [sys.executable, SCRIPT, "--dry-run", "--megatron-lm", megatron_lm_checkout, "--json", out,
           "--keep", tmp / "runs"]
    rc, log, elapsed = run([str(c) for c in cmd], TIMEOUT_S, "gpu_e2e dry run", env=launcher_env())
    assert out.exists(), log[-20000:]
    got = json.loads(out.read_text())
    failed = {name: entry.get("tail", "")[-5000:] for name, entry in got["checks"].items()
              if entry["status"] not in ("done", "skipped")}
    assert rc == 0 and not failed, (rc, failed, log[-5000:])
    print(f"gpu_e2e dry run: {elapsed:.0f} s, checks "
          + ", ".join(f"{n} {e.get('seconds', e['status'])}" for n, e in got["checks"].items()))
    return got


def test_the_report_names_the_machine_the_versions_and_every_check(report):
    assert report["torch"] and report["megatron_core"] == installed_megatron_core_version()
    assert report["device"].startswith("cpu") and report["suggested_name"].endswith(".json")
    assert report["package"]["differs_from_tree"] == []  # this checkout's code ran (no stale wheel)
    assert list(report["checks"]) == ["a", "b", "c_pretrain", "c_rl", "d"]
    assert sum(report["limits_s"].values()) > 0 and all(e.get("seconds", 0) <= e.get("limit_s", 1e9)
                                                        for e in report["checks"].values())


def test_a_every_mode_and_split_ran_and_only_the_control_moves_with_the_split(report):
    a = report["checks"]["a"]["result"]
    assert "errors" not in a, a.get("errors")
    for mode in MODES:
        runs = a["runs"][mode]
        assert len(runs) == 3 and all(r["status"] == 0 and r["iterations"] == 1 for r in runs.values()), runs
        assert len({r["weight"] for r in runs.values()}) == 1
        assert all(math.isfinite(r["objective"]) and r["grad_norm"] > 0 and r["tokens_per_s"] > 0
                   for r in runs.values())
        assert [r["microbatches"] for r in runs.values()][:2] == [1, 3] and list(runs.values())[2]["microbatches"] > 3
        assert a["spread"][mode]["objective"] <= SPLIT_OBJECTIVE, (mode, a["spread"][mode])
        assert a["spread"][mode]["grad_norm"] <= SPLIT_GRAD_NORM, (mode, a["spread"][mode])
    control, worst = a["control_spread"], max(s["objective"] for s in a["spread"].values())
    assert control["objective"] > 10 * SPLIT_OBJECTIVE and control["objective"] > 100 * worst, (control, a["spread"])
    assert control["grad_norm"] > 2 * SPLIT_GRAD_NORM, control


def test_a_control_ran_at_the_trainers_weights(report):
    """One microbatch: the per-microbatch mean is the step's own seq_mean, and our step in the
    control's session gives the trainer's record (the same initial weights)."""
    a = report["checks"]["a"]["result"]
    per = a["control"]["per_split"]
    for split, row in per.items():
        mine = a["runs"]["seq_mean"][split]
        assert row["ours_in_session"]["objective"] == pytest.approx(mine["objective"], rel=1e-5, abs=1e-7), split
        assert row["ours_in_session"]["grad_norm"] == pytest.approx(mine["grad_norm"], rel=1e-3), split
    one = per["1mb"]
    assert one["microbatches"] == 1 and one["objective"] == pytest.approx(one["ours_in_session"]["objective"], abs=1e-6)
    assert [row["microbatches"] for row in per.values()][1] == 3


def test_b_throughput_against_both_plain_losses_and_the_planner_time(report):
    b = report["checks"]["b"]["result"]
    assert "errors" not in b, b.get("errors")
    assert b["step"]["parameters"] > 0 and b["step"]["microbatches"] > 1
    assert b["step"]["microbatch_tokens_max"] <= b["step"]["cap"]
    names = {"megatron gpt loss", "bench_step baseline", *MODES, "token_mean, the trainer's loss (entropy reported)"}
    assert set(b["throughput"]) == names and set(b["step_times_s"]) == names
    for name, row in b["throughput"].items():
        assert row["tokens_per_s"] > 0 and row["vs_megatron_gpt_loss"] > 0 and row["vs_bench_step_baseline"] > 0, name
    assert all(b["planner_ms"][m] > 0 for m in MODES)
    steps = b["trainer_steps"]
    assert len(steps["step_s"]) == len(steps["plan_wait_ms"]) == 3 and all(math.isfinite(o) for o in steps["objective"])


def test_c_pretrain_runs_twenty_iterations(report):
    c = report["checks"]["c_pretrain"]["result"]
    assert c["iterations"] == 20 and [i + 1 for i in range(20)] == list(range(1, 21))
    assert all(math.isfinite(o) for o in c["objective"]) and all(g > 0 for g in c["grad_norm"])
    assert c["first"]["weight"] == c["last"]["weight"] > 0 and c["megatron_iteration_ms"]


def test_c_rl_step_and_collection_against_megatron_lms_paths(report):
    entry = report["checks"]["c_rl"]
    if not RL_RELEASE:
        assert entry["status"] == "skipped" and "megatron-core" in entry["reason"], entry
        pytest.skip(entry["reason"])
    bench = entry["result"]["bench"]
    assert "--transformer-impl" in entry["result"]["flags"] and "local" in entry["result"]["flags"]
    for kind in ("collection", "other"):
        medians = bench[kind]["median_s"]
        assert len(medians) == 4 and all(v > 0 for v in medians.values()), bench[kind]
        ratios = bench[kind]["ratio_ours_over"]
        assert {"megatron-lm packed", "megatron-lm unpacked"} <= set(ratios) and all(r > 0 for r in ratios.values())


def test_d_moe_aux_strength_is_megatrons_in_every_mode_and_the_control_is_not(report):
    d = report["checks"]["d"]["result"]
    assert "errors" not in d, d.get("errors")
    strength = d["strength"]
    assert strength["default_router_grad_max"] > 1e-5
    for mode in MODES:
        row = strength["modes"][mode]
        assert abs(row["factor"] - 1) <= 1e-5 and row["max_rel_err"] <= 1e-5, (mode, row)
        assert abs(row["unpatched"]["factor"] - 1) > 1e-2, (mode, row)
        assert row["unpatched"]["factor"] == pytest.approx(row["unpatched_predicted_factor"], rel=0.03), (mode, row)
    runs = d["trainer_runs"]
    assert all(runs[m]["status"] == 0 and runs[m]["iterations"] == 2 and runs[m]["moe_aux_loss"][1] > 0 for m in MODES)
    assert d["trainer_aux_loss_spread"] <= 1e-6
