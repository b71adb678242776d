"""A resume either continues exactly or is refused before any model is built (docs/trainer.md,
"Resume"; megatron_pg_agg/training/resume.py).

Three launches of ``workers/trainer_runs.py`` through the trainer's own ``main``: one rank (a DP1
checkpoint), two ranks (checkpoints at DP2 in fp32 and bf16 with the production flags, the runs
that change what may change, and every refusal), one rank again (the DP2 checkpoints resumed at
DP1). A change the trainer honours is held against the uninterrupted run of the same flags: the
objective is the same function of the weights on any layout (the project's contract, held to
float64 by tests/distributed/test_production_config.py), so a resume at another DP size, bucket
size or optimizer sharding must give the uninterrupted run's iterations 3 and 4 to fp32 precision,
and one in another precision must stay within bf16's bound of both precisions' uninterrupted runs.
Before the run record existed each of these lost the training or crashed (issue 58): fp32 -> bf16
left the weights at their initial values (objective -0.026 against -0.049), ``--lr`` was ignored,
a DP change failed in ``optimizer.step`` after a whole step's compute.
"""
from __future__ import annotations

import json

import pytest

from tests.support.launching import run, split_by_run, torchrun, worker
from tests.support.records import trainer_records

RUNS = worker("trainer_runs")
BASE = ["--rollouts", "synthetic", "--num-microbatches", "3", "--pg-loss-aggregation", "seq_mean"]
PROD = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "4000"]
FP32_RTOL = 1e-6
"""Resumed against uninterrupted, objective relative to max(|J|, 0.01): fp32 reduction order only."""
BF16_RTOL = 1e-2
"""A precision change against either precision's uninterrupted run, relative to max(|J|, 0.01) (as
test_production_config's 20 bf16 iterations beside fp32, measured 1.5e-3 there; here <= 4.1e-3, an
objective near 0.006 whose bf16 runs differ by 4e-5). The lost training of issue 58 moved iteration
3 back to iteration 1's objective: 1.3 on this scale."""


def _launch(tmp, name: str, nproc: int, runs: list) -> dict:
    (tmp / f"{name}.json").write_text(json.dumps(runs))
    rc, out, _ = run(torchrun(nproc, *RUNS, tmp / f"{name}.json", tmp / f"{name}.status.json"), 600, name)
    assert rc == 0, out[-20000:]
    return {"status": json.loads((tmp / f"{name}.status.json").read_text()), "out": split_by_run(out)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")

    def spec(name, *flags, iters=4):
        return {"name": name, "argv": [*BASE, *flags, "--train-iters", str(iters),
                                       "--metrics-file", str(tmp / f"{name}.jsonl")]}

    ckpt = {name: str(tmp / f"ckpt-{name}") for name in ("dp1", "fp32", "bf16")}
    first = [spec("save-dp1", *PROD, "--save", ckpt["dp1"], iters=2)]
    second = [
        spec("save-fp32", *PROD, "--save", ckpt["fp32"], iters=2),
        spec("save-bf16", *PROD, "--bf16", "--save", ckpt["bf16"], iters=2),
        spec("whole-fp32", *PROD),
        spec("whole-bf16", *PROD, "--bf16"),
        spec("dp1-to-dp2", *PROD, "--load", ckpt["dp1"]),
        spec("fp32-to-bf16", *PROD, "--bf16", "--load", ckpt["fp32"]),
        spec("bf16-to-fp32", *PROD, "--load", ckpt["bf16"]),
        spec("bucket-1000", *PROD[:-1], "1000", "--load", ckpt["fp32"]),
        spec("to-plain-ddp", "--load", ckpt["fp32"]),
        spec("lr-override", *PROD, "--lr", "0", "--override-opt_param-scheduler", "--load", ckpt["fp32"]),
        spec("lr-checkpoint", *PROD, "--lr", "0", "--use-checkpoint-opt_param-scheduler", "--load", ckpt["fp32"]),
        spec("refused-lr", *PROD, "--lr", "0", "--load", ckpt["fp32"]),
        spec("refused-both", *PROD, "--lr", "0", "--override-opt_param-scheduler",
             "--use-checkpoint-opt_param-scheduler", "--load", ckpt["fp32"]),
        spec("refused-tp", *PROD, "--tensor-model-parallel-size", "2", "--load", ckpt["fp32"]),
        spec("refused-mode", *PROD, "--pg-loss-aggregation", "token_mean", "--load", ckpt["fp32"]),
    ]
    third = [spec("dp2-to-dp1", *PROD, "--load", ckpt["fp32"]),
             spec("dp2-to-dp1-plain", "--load", ckpt["fp32"]),
             spec("bf16-dp2-to-dp1", *PROD, "--bf16", "--load", ckpt["bf16"])]
    results = {}
    for name, nproc, batch in (("first", 1, first), ("second", 2, second), ("third", 1, third)):
        launched = _launch(tmp, name, nproc, batch)
        for r in batch:
            results[r["name"]] = {"status": launched["status"][r["name"]], "out": launched["out"].get(r["name"], ""),
                                  "records": trainer_records(tmp / f"{r['name']}.jsonl")
                                  if (tmp / f"{r['name']}.jsonl").exists() else ([], [])}
    return results


def _objective_err(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 0.01)


def _resumed(runs, name: str, reference: str, rtol: float) -> float:
    """Worst objective difference of ``name``'s iterations 3-4 from ``reference``'s (asserted <= rtol)."""
    assert runs[name]["status"] == 0, runs[name]["out"][-8000:]
    got, want = runs[name]["records"][0], runs[reference]["records"][0]
    assert [r["iteration"] for r in got] == [3, 4], name
    worst = max(_objective_err(g["objective"], w["objective"]) for g, w in zip(got, want[2:]))
    assert worst <= rtol, (name, reference, worst, [g["objective"] for g in got], [w["objective"] for w in want[2:]])
    return worst


@pytest.mark.parametrize("name", ["dp1-to-dp2", "bucket-1000", "to-plain-ddp", "dp2-to-dp1", "dp2-to-dp1-plain"])
def test_a_change_of_data_parallel_size_buckets_or_sharding_continues_the_run(runs, name):
    """Catches: a rank's optimizer shard restored at the old ranges (the size mismatch in
    optimizer.step), a main parameter left at its initial value, Adam's moments or step dropped."""
    worst = _resumed(runs, name, "whole-fp32", FP32_RTOL)
    grad = [r["grad_norm"] for r in runs[name]["records"][0]]
    want = [r["grad_norm"] for r in runs["whole-fp32"]["records"][0][2:]]
    assert grad == pytest.approx(want, rel=1e-5), (name, grad, want)
    print(f"{name}: iterations 3-4 against the uninterrupted DP2 run, objective {worst:.1e}")


@pytest.mark.parametrize("name,precision", [("fp32-to-bf16", "bf16"), ("bf16-to-fp32", "fp32"),
                                            ("bf16-dp2-to-dp1", "bf16")])
def test_a_change_of_precision_continues_from_the_fp32_main_parameters(runs, name, precision):
    """Catches: the mixed-precision optimizer's fp32 main parameters never loaded (issue 58: the
    training discarded), a bf16 checkpoint resumed from its rounded weights instead of its main ones."""
    same = _resumed(runs, name, f"whole-{precision}", BF16_RTOL)
    other = _resumed(runs, name, f"whole-{'fp32' if precision == 'bf16' else 'bf16'}", BF16_RTOL)
    print(f"{name}: against the uninterrupted {precision} run {same:.1e}, the other precision {other:.1e}")


def test_the_learning_rate_follows_megatron_lms_rule(runs):
    """--lr against the checkpoint's: refused alone; the flags' with --override-opt_param-scheduler
    (lr 0: the weights stay the checkpoint's, bit for bit); the checkpoint's with
    --use-checkpoint-opt_param-scheduler (the uninterrupted run's iterations, exactly)."""
    override, keep = runs["lr-override"], runs["lr-checkpoint"]
    assert override["status"] == 0 and keep["status"] == 0, (override["out"][-5000:], keep["out"][-5000:])
    assert [r["learning_rate"] for r in override["records"][0]] == [0.0, 0.0]
    assert override["records"][1][-1]["param_checksum"] == runs["save-fp32"]["records"][1][-1]["param_checksum"]
    assert [r["learning_rate"] for r in keep["records"][0]] == [1e-3, 1e-3]
    _resumed(runs, "lr-checkpoint", "whole-fp32", FP32_RTOL)


@pytest.mark.parametrize("name,needles", [
    ("refused-lr", ["--lr 0.0 (checkpoint: 0.001)", "--override-opt_param-scheduler",
                    "--use-checkpoint-opt_param-scheduler"]),
    ("refused-both", ["--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler"]),
    ("refused-tp", ["--tensor-model-parallel-size 2 (checkpoint: 1)"]),
    ("refused-mode", ["--pg-loss-aggregation token_mean (checkpoint: seq_mean)"]),
])
def test_what_a_resume_cannot_honour_is_refused_before_any_model(runs, name, needles):
    run_ = runs[name]
    assert run_["status"] == 2, run_["out"][-5000:]
    assert "refusing to start:" in run_["out"]
    for needle in needles:
        assert needle in run_["out"], (needle, run_["out"][-3000:])
    assert run_["records"] == ([], [])  # no step ran
