"""Failure modes of the trainer: bad data refused before training, non-finite losses and
gradients stopped (status 3) or skipped, a W = 0 step, a killed or hung rank ends the job, and a
run resumes bit for bit from its checkpoint (clean exit mid-cycle, and a kill with torn saves).

Single-process runs (no torchrun) where the property does not need two ranks: they are faster and
their exit status is the trainer's own."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_pg_agg.data.rollout_files import write_rollouts
from megatron_pg_agg.data.rollouts import Rollout
from megatron_pg_agg.data.synthetic import synthetic_rollouts
from megatron_pg_agg.training.metrics import read_runs
from megatron_pg_agg.training.run_config import RunConfig, StartupError, build_parser
from tests.support.launching import ROOT, child_env, finish, kill_launch, run, start, torchrun, worker
from tests.support.records import trainer_records

TRAIN = ROOT / "launch" / "train_actor.py"
TIMING = {"tokens_per_s", "step_s"}


def _same(a, b):
    return {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}


# ----------------------------------------------------------------------------- refused at start-up


def _one_process(argv, **env):
    return run([sys.executable, str(TRAIN), *map(str, argv)], 60, "trainer", env=child_env(**env))


def test_a_bad_rollout_line_is_refused_with_file_line_field_and_nothing_trains(tmp_path):
    path = write_rollouts(tmp_path / "steps.jsonl", synthetic_rollouts(num_steps=2, vocab_size=128))
    lines = open(path).read().splitlines()
    bad = json.loads(lines[4])
    bad["advantages"] = bad["advantages"][:-1]  # a length mismatch on line 5
    lines[4] = json.dumps(bad)
    open(path, "w").write("\n".join(lines) + "\n")
    metrics = tmp_path / "m.jsonl"
    rc, out, _ = _one_process(["--rollouts", path, "--metrics-file", metrics, "--save", tmp_path / "ck"])
    assert rc == 2, out[-3000:]
    assert f"{path}:5: field 'advantages'" in out
    assert not metrics.exists() and not (tmp_path / "ck").exists()


def test_a_sequence_longer_than_the_microbatch_capacity_is_named(tmp_path):
    steps = synthetic_rollouts(vocab_size=128, seed=1234)  # the trainer's built-in set
    lengths = {(k, i): len(r.prompt_ids) + len(r.response_ids) for k in steps for i, r in enumerate(steps[k])}
    cap = max(lengths.values()) - 1
    step, index = min(key for key, n in lengths.items() if n > cap)
    rc, out, _ = _one_process(["--rollouts", "synthetic", "--max-tokens-per-microbatch", cap])
    assert rc == 2, out[-3000:]
    assert f"step {step}: rollout {index} (group '{steps[step][index].group_id}')" in out
    assert f"do not fit a microbatch of {cap} tokens" in out and "max_tokens_per_microbatch" in out


def test_a_step_too_small_for_its_microbatches_is_refused(tmp_path):
    steps = synthetic_rollouts(num_steps=1, vocab_size=128)
    path = write_rollouts(tmp_path / "s.jsonl", {0: steps[0][:3]})
    rc, out, _ = _one_process(["--rollouts", path, "--num-microbatches", 2], WORLD_SIZE="2")
    assert rc == 2 and "fewer than the 4 microbatches" in out, out[-3000:]


def test_megatron_core_outside_the_supported_range_is_refused(monkeypatch):
    import megatron_pg_agg.training.run_config as run_config

    cfg = RunConfig.from_args(build_parser().parse_args([]))
    monkeypatch.delenv("MEGATRON_PG_AGG_ALLOW_UNTESTED_MEGATRON", raising=False)
    monkeypatch.setattr(run_config, "installed_megatron_core_version", lambda: "0.14.0")
    with pytest.raises(StartupError, match="megatron-core 0.14.0 is outside the supported range"):
        cfg.validate(2, backend="gloo", te=False)
    monkeypatch.setattr(run_config, "installed_megatron_core_version", lambda: "0.20.0")
    with pytest.raises(StartupError, match="megatron-core 0.20.0 is newer than the tested range"):
        cfg.validate(2, backend="gloo", te=False)
    for release in ("0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2"):
        monkeypatch.setattr(run_config, "installed_megatron_core_version", lambda r=release: r)
        cfg.validate(2, backend="gloo", te=False)


# ----------------------------------------------------------------------------- non-finite steps


def _poison(r, kind):
    """A valid token with an absurd (finite, loadable) old log-prob -1e4: the ratio overflows.
    kind 'loss': the token is in the numerator, so the loss is inf. kind 'gradient': the token is
    filtered out of the numerator only (still in the denominator): torch.where keeps the loss
    finite, but exp()'s backward multiplies the zero upstream gradient by the inf ratio, so the
    gradient is NaN while the loss and every report are finite."""
    n = len(r.response_ids)
    numerator = [1] * n if kind == "loss" else [0] + [1] * (n - 1)
    return Rollout(r.prompt_ids, r.response_ids, [1] * n, [-1.0] * n, [-1e4] + list(r.old_logprobs[1:]),
                   r.group_id, r.ref_logprobs, numerator)


def _poisoned_steps(*kinds):
    """Step 0 clean, steps 1..k poisoned (one kind each), step k+1 clean."""
    steps = synthetic_rollouts(num_steps=len(kinds) + 2, vocab_size=128)
    for step, kind in enumerate(kinds, start=1):
        steps[step][0] = _poison(steps[step][0], kind)
    return steps


def test_a_non_finite_loss_stops_the_run_before_any_update_with_status_3(tmp_path):
    """Two ranks under torchrun: torchrun itself exits 1 when a worker fails, and names each
    worker's own status, which must be the documented 3."""
    path = write_rollouts(tmp_path / "s.jsonl", _poisoned_steps("loss"))
    metrics = tmp_path / "m.jsonl"
    rc, out, _ = run(torchrun(2, TRAIN, "--rollouts", path, "--train-iters", 3, "--metrics-file", metrics),
                     300, "poisoned run", fresh=True)  # torchrun's own report is checked
    assert rc != 0, out[-5000:]
    assert "exitcode  : 3" in out, out[-5000:]
    assert "iteration 1 (rollout step 1): non-finite loss or gradient; nothing was updated" in out
    steps, final = trainer_records(metrics)
    assert [r["iteration"] for r in steps] == [1] and not final


# trainer.main in a child process, then whether it left its process group alive (a live gloo
# group at exit can abort the process in the group's destructor, turning status 3 into -6)
_MAIN_THEN_GROUP = ("import sys, torch.distributed as d; from megatron_pg_agg.online.cli import main; "
                    "rc = main(sys.argv[1:]); print('process group alive after main:', d.is_initialized()); "
                    "sys.exit(rc)")


def test_a_finite_loss_with_a_non_finite_gradient_stops_with_status_3(tmp_path):
    """The gradient path of the finiteness check on its own (one process: the status is the
    trainer's own): the loss of step 1 is finite, its gradient is NaN. The stop destroys the
    process group before returning its status."""
    path = write_rollouts(tmp_path / "s.jsonl", _poisoned_steps("gradient"))
    metrics = tmp_path / "m.jsonl"
    argv = ["--rollouts", path, "--train-iters", 3, "--metrics-file", metrics]
    rc, out, _ = run([sys.executable, "-c", _MAIN_THEN_GROUP, *map(str, argv)], 60, "trainer", env=child_env())
    assert rc == 3, out[-5000:]
    assert "process group alive after main: False" in out, out[-3000:]
    assert "iteration 1 (rollout step 1): non-finite loss or gradient; nothing was updated" in out
    steps, final = trainer_records(metrics)
    assert [r["iteration"] for r in steps] == [1] and not final
    assert all(math.isfinite(steps[0][k]) for k in ("objective", "grad_norm"))


def test_skip_nonfinite_steps_skips_loss_and_gradient_failures_and_leaves_the_model_untouched(tmp_path):
    poisoned = _poisoned_steps("loss", "gradient")
    path = write_rollouts(tmp_path / "s.jsonl", poisoned)
    clean = write_rollouts(tmp_path / "clean.jsonl", {0: poisoned[0], 1: poisoned[3]})
    m_skip, m_clean = tmp_path / "skip.jsonl", tmp_path / "clean_m.jsonl"
    rc, out, _ = _one_process(["--rollouts", path, "--train-iters", 4, "--metrics-file", m_skip,
                               "--pg-skip-nonfinite-steps"])
    assert rc == 0, out[-20000:]
    rc, out2, _ = _one_process(["--rollouts", clean, "--train-iters", 2, "--metrics-file", m_clean])
    assert rc == 0, out2[-20000:]
    skip, skip_final = trainer_records(m_skip)
    ref, ref_final = trainer_records(m_clean)
    assert [r["skipped"] for r in skip] == [False, True, True, False] and skip[-1]["skipped_total"] == 2
    assert skip_final[0]["skipped_total"] == 2
    # the gradient-poisoned step reported a finite loss: only the gradient check can skip it
    assert math.isfinite(skip[2]["objective"]) and not math.isfinite(skip[1]["objective"])
    # the skipped steps changed nothing: the last step trains exactly as if they never existed
    assert skip[3]["objective"] == ref[1]["objective"] and skip[3]["grad_norm"] == ref[1]["grad_norm"]
    assert skip_final[0]["param_checksum"] == ref_final[0]["param_checksum"]


def test_the_skipped_step_counter_survives_a_resume(tmp_path):
    """Two steps skipped (iterations 2 and 3), a checkpoint at 3, a run resumed from it: iteration
    4's record equals the uninterrupted run's, skipped_total included (2, not 0), and so does the
    final record. Catches a counter not saved, not restored, or reset at start-up."""
    path = write_rollouts(tmp_path / "s.jsonl", _poisoned_steps("loss", "gradient"))
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = ["--rollouts", path, "--train-iters", 4, "--pg-skip-nonfinite-steps"]
    rc, out, _ = _one_process([*common, "--save", full, "--save-interval", 3])
    assert rc == 0, out[-20000:]
    resumed.mkdir()
    shutil.copytree(full / "iter_0000003", resumed / "iter_0000003")
    (resumed / "latest").write_text("3\n")
    rc, out, _ = _one_process([*common, "--save", resumed, "--load", resumed])
    assert rc == 0 and "start_iteration=3" in out, out[-20000:]
    a, a_final = trainer_records(full / "metrics.jsonl")
    b, b_final = trainer_records(resumed / "metrics.jsonl")
    assert [r["skipped_total"] for r in a] == [0, 1, 2, 2] and [r["iteration"] for r in b] == [4]
    assert _same(a[3], b[0]), (a[3], b[0])
    assert a_final[0]["skipped_total"] == b_final[-1]["skipped_total"] == 2


def test_each_run_in_a_shared_metrics_file_is_marked_and_read_apart(tmp_path):
    """Two fresh runs append to one metrics file: each opens with a run-start record (its id, the
    command line, the model, the versions, the first iteration) and every record it writes
    carries that id; read_runs gives them apart. Catches records without the id, a run id reused
    by a fresh run, or the start record missing."""
    metrics = tmp_path / "m.jsonl"
    for iters in (2, 3):
        rc, out, _ = _one_process(["--rollouts", "synthetic", "--train-iters", iters, "--metrics-file", metrics])
        assert rc == 0, out[-20000:]
    first, second = read_runs(metrics)
    assert first.run_id and second.run_id and first.run_id != second.run_id
    assert [r["iteration"] for r in first.steps] == [1, 2] and [r["iteration"] for r in second.steps] == [1, 2, 3]
    assert len(first.finals) == len(second.finals) == 1
    (start,) = second.starts
    assert start["start_iteration"] == 0 and "--train-iters" in start["argv"] and "3" in start["argv"]
    assert start["model"].startswith("built-in GPT") and start["mode"] == "token_mean"
    assert set(start["versions"]) == {"megatron_pg_agg", "megatron_core", "torch", "python"}
    lines = [json.loads(line) for line in open(metrics)]
    assert all(r.get("run_id") in (first.run_id, second.run_id) for r in lines) and len(lines) == 2 + 2 + 3 + 2


# ----------------------------------------------------------------------------- W = 0


def test_a_step_with_every_response_masked_is_a_zero_update_with_finite_metrics(tmp_path):
    """W = 0 for a whole step (every token masked): J = 0 and zero gradients by the contract; the
    trainer logs it (weight 0, objective 0, grad_norm 0, nothing else non-finite) and leaves the
    model and optimizer untouched: the next step trains exactly as if the empty step never was."""
    steps = synthetic_rollouts(num_steps=3, vocab_size=128)
    steps[1] = [Rollout(r.prompt_ids, r.response_ids, [0] * len(r.response_ids), r.advantages,
                        r.old_logprobs, r.group_id, r.ref_logprobs, None) for r in steps[1]]
    path = write_rollouts(tmp_path / "s.jsonl", steps)
    clean = write_rollouts(tmp_path / "clean.jsonl", {0: steps[0], 1: steps[2]})
    m_empty, m_clean = tmp_path / "empty.jsonl", tmp_path / "clean_m.jsonl"
    outputs = []
    for rollouts, iters, metrics in ((path, 3, m_empty), (clean, 2, m_clean)):
        rc, out, _ = _one_process(["--rollouts", rollouts, "--train-iters", iters, "--metrics-file", metrics,
                                   "--pg-loss-aggregation", "seq_mean"])
        assert rc == 0, out[-20000:]
        outputs.append(out)
    got, got_final = trainer_records(m_empty)
    ref, ref_final = trainer_records(m_clean)
    empty = got[1]
    assert empty["weight"] == 0 and empty["valid_tokens"] == 0 and empty["rollout_step"] == 1
    assert empty["objective"] == 0.0 and empty["grad_norm"] == 0.0 and not empty["skipped"]
    for key, value in empty.items():
        assert value is None or isinstance(value, (bool, str)) or math.isfinite(value), (key, value)
    assert any("] 2/3 objective=0 weight=0 " in line for line in outputs[0].splitlines()), outputs[0][-3000:]
    assert got[2]["objective"] == ref[1]["objective"] and got[2]["grad_norm"] == ref[1]["grad_norm"]
    assert got_final[0]["param_checksum"] == ref_final[0]["param_checksum"]


# ----------------------------------------------------------------------------- dead ranks


def _wait_for(proc, needle, timeout_s, seen):
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            return
        if time.monotonic() > deadline:
            break
    pytest.fail(f"never saw {needle!r}; output:\n{''.join(seen)[-10000:]}")


def test_a_rank_killed_mid_run_ends_the_whole_job_quickly(tmp_path):
    proc = start(torchrun(2, TRAIN, "--rollouts", "synthetic", "--train-iters", 100000, "--metrics-file",
                          tmp_path / "m.jsonl",
                          "--distributed-timeout-minutes", 1))
    seen = []
    _wait_for(proc, "] 2/100000", 120, seen)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[1]), signal.SIGKILL)
    t0 = time.monotonic()
    rc, rest = finish(proc, 120, "torchrun after a rank was killed")
    elapsed = time.monotonic() - t0
    out = "".join(seen) + rest
    assert rc != 0
    assert "Signal 9 (SIGKILL)" in out or "exitcode  : -9" in out, out[-5000:]
    assert elapsed < 60, f"job took {elapsed:.1f}s to end after the kill"


def test_a_hung_rank_fails_the_job_after_the_distributed_timeout(tmp_path):
    """A rank that hangs (alive, silent) before its first step: the other rank's first collective
    with it must fail after --distributed-timeout-minutes (0.05 min = 3000 ms), ending the job.
    Megatron's own groups (DP here: DDP's gradient all-reduce) must get that timeout too, not
    megatron-core's default of 30 minutes."""
    rc, out, _ = run(torchrun(2, *worker("hang_worker"), "--rollouts", "synthetic", "--train-iters", 2,
                              "--metrics-file", tmp_path / "m.jsonl", "--distributed-timeout-minutes", 0.05), 240,
                     "job with a hung rank", fresh=True)  # torchrun's handling of a failed and a hung rank
    assert rc != 0, out[-5000:]
    assert "rank 1 hangs before its first step" in out
    assert "3000ms" in out, out[-5000:]  # gloo names the timeout that fired: ours, not a default
    assert "] 1/2" not in out  # no step completed


# ----------------------------------------------------------------------------- checkpoints


def _final_state(directory, iteration, rank):
    return torch.load(os.path.join(directory, f"iter_{iteration:07d}", f"rank_{rank:05d}.pt"), weights_only=False)


def _assert_bitwise_equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _assert_same_states(a_dir, b_dir, iteration, ranks):
    for rank in ranks:
        sa, sb = _final_state(a_dir, iteration, rank), _final_state(b_dir, iteration, rank)
        _assert_bitwise_equal(sa["model"], sb["model"], "model")
        _assert_bitwise_equal(sa["optimizer"], sb["optimizer"], "optimizer")
        assert sa["iteration"] == sb["iteration"] == iteration


@pytest.mark.parametrize("threads", ["1", "2"])
def test_resume_from_a_checkpoint_mid_cycle_restores_the_data_position(tmp_path, threads):
    """Deterministic (no kill): an uninterrupted 5-iteration run saves at iteration 3 (not a
    multiple of the 4 rollout steps) and at 5; a second run resumes from a copy of the
    iteration-3 checkpoint alone (--load) and must train rollout steps 3 then 0 and end bit for
    bit where the uninterrupted run did. The 4 steps differ visibly (their weights differ), so
    restarting the data at step 0 cannot pass. The promise holds at 1 thread and at torch's
    default of 2 on this kind of machine (both runs use the same count): resume restores the
    weights, the optimizer state and the RNG exactly, so the same kernels see the same inputs."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    rc, out, _ = _one_process(["--rollouts", "synthetic", "--train-iters", 5, "--save", full, "--save-interval", 3],
                              OMP_NUM_THREADS=threads)
    assert rc == 0, out[-20000:]
    resumed.mkdir()
    shutil.copytree(full / "iter_0000003", resumed / "iter_0000003")
    (resumed / "latest").write_text("3\n")
    rc, out, _ = _one_process(["--rollouts", "synthetic", "--train-iters", 5, "--save", resumed, "--load", resumed],
                              OMP_NUM_THREADS=threads)
    assert rc == 0, out[-20000:]
    assert "start_iteration=3" in out
    a, a_final = trainer_records(full / "metrics.jsonl")
    b, b_final = trainer_records(resumed / "metrics.jsonl")
    assert [r["rollout_step"] for r in a] == [0, 1, 2, 3, 0]
    assert len({r["weight"] for r in a[:4]}) == 4  # every rollout step is recognisable by its weight
    assert [r["iteration"] for r in b] == [4, 5]
    assert [r["rollout_step"] for r in b] == [3, 0]
    for x, y in zip(a[3:], b):
        assert _same(x, y), (x, y)
    assert a_final[0]["param_checksum"] == b_final[-1]["param_checksum"]
    _assert_same_states(full, resumed, 5, [0])
    # the resumed run is the same run: its checkpoint's id, and a start record saying where it began
    (run_a,), (run_b,) = read_runs(full / "metrics.jsonl"), read_runs(resumed / "metrics.jsonl")
    assert run_b.run_id == run_a.run_id and [r["start_iteration"] for r in run_b.starts] == [3]


def test_a_killed_run_resumes_bit_for_bit_and_ignores_torn_saves(tmp_path):
    """A 2-rank run killed (launcher and workers, SIGKILL) at whatever point after its checkpoint
    at iteration 4, plus two torn saves (one rank's file truncated; one rank's file missing) that
    ``latest`` never named: the resumed run starts from ``latest`` and, two iterations later,
    matches an uninterrupted run of the same length bit for bit. No assertion depends on where the
    kill landed: the comparison run is sized from the checkpoint the kill left."""
    broken, full = tmp_path / "broken", tmp_path / "full"
    proc = start(torchrun(2, TRAIN, "--rollouts", "synthetic", "--train-iters", 100000, "--save", broken,
                          "--save-interval", 2))
    seen = []
    _wait_for(proc, "] 5/100000", 240, seen)  # iteration 4's checkpoint is complete by now
    kill_launch(proc)
    finish(proc, 60, "a killed launch")
    latest = int(open(broken / "latest").read())
    assert latest >= 4 and latest % 2 == 0
    # torn saves of later iterations ``latest`` never named (odd: never a real save here)
    truncated = broken / f"iter_{latest + 1:07d}"
    truncated.mkdir(exist_ok=True)
    (truncated / "rank_00000.pt").write_bytes(b"truncated")
    missing = broken / f"iter_{latest + 3:07d}"
    missing.mkdir(exist_ok=True)
    shutil.copy(broken / f"iter_{latest:07d}" / "rank_00000.pt", missing / "rank_00000.pt")  # rank 1's never written
    target = latest + 2

    rc, out, _ = run(torchrun(2, TRAIN, "--rollouts", "synthetic", "--train-iters", target, "--save", broken,
                              "--save-interval", 2, "--load", broken), 300, "resumed run")
    assert rc == 0, out[-20000:]
    assert f"start_iteration={latest}" in out
    rc, out, _ = run(torchrun(2, TRAIN, "--rollouts", "synthetic", "--train-iters", target, "--save", full), 300,
                     "uninterrupted run")
    assert rc == 0, out[-20000:]

    a, a_final = trainer_records(full / "metrics.jsonl")
    b, b_final = trainer_records(broken / "metrics.jsonl")
    resumed = b[-2:]
    assert [r["iteration"] for r in resumed] == [latest + 1, latest + 2]
    for x, y in zip(a[latest:], resumed):
        assert _same(x, y), (x, y)
    for x, y in zip(a[:latest], b[:latest]):  # the killed run, up to its checkpoint
        assert _same(x, y), (x, y)
    assert a_final[0]["param_checksum"] == b_final[-1]["param_checksum"]
    _assert_same_states(full, broken, target, [0, 1])
