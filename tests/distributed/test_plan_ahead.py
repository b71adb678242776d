"""The next plan in the background (``--pg-plan-ahead``, megatron_pg_agg/data/plan_ahead.py)
through the trainer's command line: the same run with it on and off, and a plan that fails at a
later iteration."""
import json

from tests.support.launching import run, torchrun, worker
from tests.support.records import trainer_records

RUNS = worker("plan_ahead_runs")
TIMING = {"tokens_per_s", "step_s"}


def test_plan_ahead_on_and_off_train_alike_and_a_later_plans_error_stops_that_iteration(tmp_path):
    """DP=2, 6 iterations over the 4 built-in rollout steps (the cycle wraps): with plan-ahead (the
    default) and with --no-pg-plan-ahead every recorded field but the timings and the final
    parameter checksum are equal bit for bit. A run whose iteration-3 plan raises a rollout-file
    error (naming its file and line; raised on the background thread while iteration 2 runs)
    records iterations 1 to 3, then stops with that very error, and the launch ends (no thread
    keeps it alive). Would catch plans handed to the wrong iteration, a plan-ahead run that differs
    from the synchronous one, or an error raised early, swallowed or rewritten."""
    runs = [{"name": name, "argv": ["--rollouts", "synthetic", *extra, "--train-iters", "6",
                                    "--metrics-file", str(tmp_path / f"{name}.jsonl")],
             "env": env}
            for name, extra, env in (("on", [], {}), ("off", ["--no-pg-plan-ahead"], {}),
                                     ("error", [], {"PG_TEST_FAIL_PLAN_AT": "3"}))]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    rc, out, _ = run(torchrun(2, *RUNS, tmp_path / "runs.json", tmp_path / "status.json"), 300, "plan-ahead runs")
    assert rc == 0, out[-20000:]
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["on"] == status["off"] == 0, out[-20000:]
    want = "RolloutFormatError: rollouts.jsonl:12: field 'step': is -1; expected an integer >= 0"
    assert status["error"] == want, status["error"]
    (on, on_final), (off, off_final) = trainer_records(tmp_path / "on.jsonl"), trainer_records(tmp_path / "off.jsonl")
    assert [r["iteration"] for r in on] == list(range(1, 7)) and [r["rollout_step"] for r in on] == [0, 1, 2, 3, 0, 1]
    for a, b in zip(on, off):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}
    assert on_final[0]["param_checksum"] == off_final[0]["param_checksum"]
    failed, final = trainer_records(tmp_path / "error.jsonl")
    assert [r["iteration"] for r in failed] == [1, 2, 3] and final == []
    for a, b in zip(failed, on):  # the iterations before the failure trained as the clean run
        assert a["objective"] == b["objective"]


def test_megatron_lm_pretrain_with_plan_ahead_on_and_off_records_the_same_run(megatron_lm_checkout, tmp_path):
    """Megatron-LM's pretrain() entry, one process, 6 iterations over the 4 built-in rollout steps,
    from the same seed: with --pg-plan-ahead (default: the start-up check keeps no plan, each
    iteration planned in the background) and --no-pg-plan-ahead (the start-up plans kept and read)
    every record is equal bit for bit (objective, weight, grad norm, ...). Would catch the feed
    handing an iteration another iteration's plan (after the cycle wraps, or at the per-iteration
    record) or plans that differ when built on the thread."""
    from tests.distributed.test_megatron_lm import LOSS, TINY
    from tests.support.launching import launch_command

    megatron_lm_runs = worker("megatron_lm_runs")

    runs = [{"name": name, "argv": ["--megatron-lm", str(megatron_lm_checkout), *TINY, *LOSS, *extra,
                                    "--train-iters", "6", "--pg-metrics-file", str(tmp_path / f"{name}.jsonl")]}
            for name, extra in (("on", []), ("off", ["--no-pg-plan-ahead"]))]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    rc, out, _ = run(launch_command(1, megatron_lm_runs, tmp_path / "runs.json", tmp_path / "status.json"), 240,
                     "Megatron-LM plan-ahead runs")
    assert rc == 0 and json.loads((tmp_path / "status.json").read_text()) == {"on": 0, "off": 0}, out[-20000:]
    on, off = (trainer_records(tmp_path / f"{name}.jsonl")[0] for name in ("on", "off"))
    assert [r["iteration"] for r in on] == list(range(1, 7)) and [r["rollout_step"] for r in on] == [0, 1, 2, 3, 0, 1]
    assert on == off
