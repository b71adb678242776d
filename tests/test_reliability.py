"""Failure modes of the trainer: bad data refused before training, non-finite steps stopped or
skipped, a killed rank ends the job, and a killed run resumes bit for bit from its checkpoint."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from launching import ROOT, child_env, finish, run, start, torchrun
from megatron_pg_agg.planner import Rollout
from megatron_pg_agg.rollout_io import write_rollouts
from megatron_pg_agg.trainer import StartupError, build_parser, synthetic_rollouts, validate_startup

TRAIN = ROOT / "launch" / "train_actor.py"
TIMING = {"tokens_per_s", "step_s"}


def _records(path):
    lines = [json.loads(line) for line in open(path)]
    return [r for r in lines if not r.get("final")], [r for r in lines if r.get("final")]


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
    rc, out, _ = _one_process(["--max-tokens-per-microbatch", cap])
    assert rc == 2, out[-3000:]
    assert f"step {step}, rollout {index} (group '{steps[step][index].group_id}')" in out
    assert f"do not fit a microbatch of max_tokens_per_microbatch={cap}" in out


def test_a_step_too_small_for_its_microbatches_is_refused(tmp_path):
    steps = synthetic_rollouts(num_steps=1, vocab_size=128)
    path = write_rollouts(tmp_path / "s.jsonl", {0: steps[0][:3]})
    rc, out, _ = _one_process(["--rollouts", path, "--num-microbatches", 2], WORLD_SIZE="2")
    assert rc == 2 and "fewer than the 4 microbatches" in out, out[-3000:]


def test_megatron_core_outside_the_supported_range_is_refused(monkeypatch):
    import megatron_pg_agg.trainer as trainer

    monkeypatch.setattr(trainer, "megatron_core_version", lambda: "0.17.0")
    with pytest.raises(StartupError, match="megatron-core 0.17.0 is outside the supported range"):
        validate_startup(build_parser().parse_args([]), 2, backend="gloo", te=False)
    monkeypatch.setattr(trainer, "megatron_core_version", lambda: "0.16.1")
    validate_startup(build_parser().parse_args([]), 2, backend="gloo", te=False)


# ----------------------------------------------------------------------------- non-finite steps


def _poisoned_steps():
    """Step 1 has a finite but absurd old log-prob (-1e4) at a valid token with a negative
    advantage: it passes every input check, yet the ratio overflows and the loss is inf."""
    steps = synthetic_rollouts(num_steps=3, vocab_size=128)
    r = steps[1][0]
    steps[1][0] = Rollout(r.prompt_ids, r.response_ids, [1] * len(r.response_ids), [-1.0] * len(r.response_ids),
                          [-1e4] + list(r.old_logprobs[1:]), r.group_id, r.ref_logprobs, None)
    return steps


def test_a_non_finite_step_stops_the_run_before_any_update(tmp_path):
    path = write_rollouts(tmp_path / "s.jsonl", _poisoned_steps())
    metrics = tmp_path / "m.jsonl"
    rc, out, _ = run(torchrun(2, TRAIN, "--rollouts", path, "--train-iters", 3, "--metrics-file", metrics),
                     300, "poisoned run")
    assert rc != 0, out[-5000:]
    assert "iteration 1 (rollout step 1): non-finite loss or gradient; nothing was updated" in out
    steps, final = _records(metrics)
    assert [r["iteration"] for r in steps] == [1] and not final


def test_skip_nonfinite_steps_skips_counts_and_leaves_the_model_untouched(tmp_path):
    poisoned = _poisoned_steps()
    path = write_rollouts(tmp_path / "s.jsonl", poisoned)
    clean = write_rollouts(tmp_path / "clean.jsonl", {0: poisoned[0], 1: poisoned[2]})
    m_skip, m_clean = tmp_path / "skip.jsonl", tmp_path / "clean_m.jsonl"
    rc, out, _ = run(torchrun(2, TRAIN, "--rollouts", path, "--train-iters", 3, "--metrics-file", m_skip,
                              "--pg-skip-nonfinite-steps"), 300, "skipping run")
    assert rc == 0, out[-20000:]
    rc, out2, _ = run(torchrun(2, TRAIN, "--rollouts", clean, "--train-iters", 2, "--metrics-file", m_clean),
                      300, "clean run")
    assert rc == 0, out2[-20000:]
    skip, skip_final = _records(m_skip)
    ref, ref_final = _records(m_clean)
    assert [r["skipped"] for r in skip] == [False, True, False] and skip[-1]["skipped_total"] == 1
    # the skipped step changed nothing: step 2 trains exactly as if step 1 never existed
    assert skip[2]["objective"] == ref[1]["objective"] and skip[2]["grad_norm"] == ref[1]["grad_norm"]
    assert skip_final[0]["param_checksum"] == ref_final[0]["param_checksum"]


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
    proc = start(torchrun(2, TRAIN, "--train-iters", 100000, "--metrics-file", tmp_path / "m.jsonl",
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


def test_a_run_killed_after_a_checkpoint_resumes_bit_for_bit(tmp_path):
    iters = 8
    full, broken = tmp_path / "full", tmp_path / "broken"
    rc, out, _ = run(torchrun(2, TRAIN, "--train-iters", iters, "--save", full), 300, "uninterrupted run")
    assert rc == 0, out[-20000:]

    # the same run, but long enough that the kill surely lands mid-run (train-iters only sizes
    # the progress bar: the first 8 iterations are the same computation)
    proc = start(torchrun(2, TRAIN, "--train-iters", 100000, "--save", broken, "--save-interval", 2))
    seen = []
    _wait_for(proc, "] 5/100000", 120, seen)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher, mid-run: its workers must follow it
    finish(proc, 60, "workers of a killed launcher")  # returns once every worker closed its output
    latest = int(open(broken / "latest").read())
    assert 2 <= latest < iters
    # a save that died half-way: files of a later iteration exist, ``latest`` was never moved
    partial = broken / f"iter_{latest + 1:07d}"
    partial.mkdir(exist_ok=True)
    (partial / "rank_00000.pt").write_bytes(b"truncated")

    rc, out, _ = run(torchrun(2, TRAIN, "--train-iters", iters, "--save", broken, "--save-interval", 2,
                              "--load", broken), 300, "resumed run")
    assert rc == 0, out[-20000:]
    assert f"start_iteration={latest}" in out

    a, a_final = _records(full / "metrics.jsonl")
    b, b_final = _records(broken / "metrics.jsonl")
    resumed = [r for r in b if r["iteration"] > latest][-(iters - latest):]
    assert [r["iteration"] for r in resumed] == list(range(latest + 1, iters + 1))
    for x, y in zip(a[latest:], resumed):
        assert _same(x, y), (x, y)
    assert a_final[0]["param_checksum"] == b_final[-1]["param_checksum"]
    for rank in (0, 1):
        sa, sb = _final_state(full, iters, rank), _final_state(broken, iters, rank)
        _assert_bitwise_equal(sa["model"], sb["model"], "model")
        _assert_bitwise_equal(sa["optimizer"], sb["optimizer"], "optimizer")
        assert sa["iteration"] == sb["iteration"] == iters
