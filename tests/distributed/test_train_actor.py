"""The main job: launch/train_actor.py under torchrun, start-up refusals, and two loopback nodes."""
import json
import sys

import pytest

from tests.support.launching import ROOT, child_env, finish, free_port, run, start, torchrun, worker

TRAIN = ROOT / "launch" / "train_actor.py"
REFERENCE = worker("trainer_reference")
MULTINODE = ROOT / "launch" / "multinode.sh"
FIELDS = ("objective", "weight", "clip_fraction", "kl", "entropy", "grad_norm", "tokens_per_s")


def _records(path):
    lines = [json.loads(line) for line in open(path)]
    return [r for r in lines if not r.get("final")], [r for r in lines if r.get("final")]


def test_main_job_trains_logs_every_step_and_writes_metrics(tmp_path):
    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    # --save only adds checkpoints (at 10 and 20): the training is the main job's
    rc, out, elapsed = run(torchrun(2, TRAIN, "--metrics-file", metrics, "--save", ckpt, "--save-interval", 10),
                           300, "main job")
    assert rc == 0, out[-20000:]
    progress = [line for line in out.splitlines() if line.startswith("[train] [")]
    assert len(progress) == 20, out[-5000:]
    for line in progress:
        for field in FIELDS:
            assert f"{field}=" in line, (field, line)
    steps, final = _records(metrics)
    assert [r["iteration"] for r in steps] == list(range(1, 21))
    for r in steps:
        assert r["weight"] > 0 and 0 <= r["clip_fraction"] <= 1 and r["entropy"] > 0
        assert r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and not r["skipped"]
    assert len(final) == 1 and final[0]["iteration"] == 20
    # Iteration 11 against an independent computation from the weights the job saved after
    # iteration 10: one process, every response forwarded alone, the objective in float64 from the
    # README's formulas (parity.step_objective), its gradient by autograd. The logged objective
    # and the pre-clip gradient norm must agree: a doubled (or halved) loss, a wrong mode or a
    # gradient off by any factor cannot.
    ref_out = tmp_path / "reference.json"
    rc, log, _ = run([sys.executable, *REFERENCE, str(ckpt / "iter_0000010" / "rank_00000.pt"),
                      str(steps[10]["rollout_step"]), str(ref_out), "--"], 300, "trainer reference", env=child_env())
    assert rc == 0, log[-10000:]
    ref = json.loads(ref_out.read_text())
    got = steps[10]
    assert ref["iteration"] == 10 and got["iteration"] == 11
    assert got["weight"] == ref["weight"]
    obj_err = abs(got["objective"] - ref["objective"]) / abs(ref["objective"])
    norm_err = abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
    assert obj_err <= 2e-6 and norm_err <= 1e-5, (obj_err, norm_err, got, ref)  # float32 sums vs float64
    print(f"main job: {elapsed:.1f}s; iteration 11 vs reference: objective {obj_err:.1e}, grad_norm {norm_err:.1e}")


@pytest.mark.parametrize("argv,env,words", [
    (["--pg-loss-aggregation", "constant"], {}, ["--pg-loss-aggregation-divisor"]),
    (["--pg-loss-aggregation-divisor", "8"], {}, ["constant"]),
    (["--tensor-model-parallel-size", "2"], {"WORLD_SIZE": "3"}, ["not divisible", "TP x PP x CP"]),
    (["--pipeline-model-parallel-size", "3"], {"WORLD_SIZE": "3"}, ["--num-layers 2", "not divisible"]),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
      "--batch-p2p-comm"], {"WORLD_SIZE": "2"}, ["interleaved", "--batch-p2p-comm"]),
    (["--no-calculate-per-token-loss"], {}, ["calculate_per_token_loss"]),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2"], {"WORLD_SIZE": "2"},
     ["--sequence-parallel needs Transformer Engine", "run on a GPU"]),
    (["--context-parallel-size", "2"], {"WORLD_SIZE": "2"},
     ["--context-parallel-size > 1 needs Transformer Engine's THD attention (GPU)"]),
    (["--bf16"], {}, ["--bf16 needs CUDA", "run fp32 on CPU"]),
    (["--rollouts", "/nonexistent/steps.jsonl"], {}, ["no such file"]),
])
def test_invalid_runs_are_refused_before_any_process_group(argv, env, words):
    # no torchrun: if validation let this through, init_process_group would wait for peers
    rc, out, _ = run([sys.executable, str(TRAIN), *argv], 60, "refused start", env=child_env(**env))
    assert rc == 2, out[-5000:]
    for word in words:
        assert word in out, (word, out[-3000:])
    assert "world=" not in out  # the run never started


def test_two_loopback_nodes_train_like_one_node(tmp_path):
    one = tmp_path / "one.jsonl"
    rc, out, _ = run(torchrun(2, TRAIN, "--train-iters", 6, "--metrics-file", one), 300, "one node")
    assert rc == 0, out[-20000:]
    port = free_port()
    two = tmp_path / "two.jsonl"
    nodes = []
    for node_rank in (0, 1):
        env = child_env(NNODES="2", NODE_RANK=str(node_rank), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), NPROC_PER_NODE="1", PYTHON=sys.executable)
        nodes.append(start(["bash", str(MULTINODE), "--train-iters", "6", "--metrics-file", two], env=env))
    outputs = [finish(p, 300, f"node {i}") for i, p in enumerate(nodes)]
    for rc, out in outputs:
        assert rc == 0, out[-20000:]
    assert "node 1/2" in outputs[1][1] and "world=2" in outputs[0][1]
    a, fa = _records(one)
    b, fb = _records(two)
    assert [r["objective"] for r in a] == [r["objective"] for r in b]
    assert fa[0]["param_checksum"] == fb[0]["param_checksum"]


def test_training_from_a_rollout_file_matches_the_built_in_data(tmp_path):
    """--rollouts: the built-in set written to JSONL and read back trains bit for bit the same."""
    from megatron_pg_agg.data.rollout_files import write_rollouts
    from megatron_pg_agg.data.synthetic import synthetic_rollouts

    path = write_rollouts(tmp_path / "steps.jsonl", synthetic_rollouts(vocab_size=128, seed=1234))
    runs = {}
    for name, extra in (("builtin", []), ("file", ["--rollouts", path])):
        metrics = tmp_path / f"{name}.jsonl"
        rc, out, _ = run(torchrun(2, TRAIN, "--train-iters", 3, "--metrics-file", metrics, *extra), 300, name)
        assert rc == 0, out[-20000:]
        runs[name] = _records(metrics)
    assert [r["objective"] for r in runs["builtin"][0]] == [r["objective"] for r in runs["file"][0]]
    assert runs["builtin"][1][0]["param_checksum"] == runs["file"][1][0]["param_checksum"]


def test_the_trainer_refuses_a_correction_without_rollout_logprobs(tmp_path):
    """The built-in rollouts carry no rollout_logprobs: exit 2 at start-up naming the field."""
    rc, out, _ = run([sys.executable, str(ROOT / "launch" / "train_actor.py"), "--pg-rollout-correction",
                      "token_truncate", "--metrics-file", tmp_path / "m.jsonl"], 120, "refused correction",
                     env=child_env())
    assert rc == 2 and "rollout_logprobs is missing" in out and "--pg-rollout-correction" in out, out[-3000:]
    rc, out, _ = run([sys.executable, str(ROOT / "launch" / "train_actor.py"), "--pg-rollout-correction",
                      "token_mask", "--pg-rollout-correction-max", "0.5", "--pg-rollout-correction-min", "0.8"],
                     120, "refused bounds", env=child_env())
    assert rc == 2 and "C > c" in out, out[-3000:]


def test_the_record_carries_the_step_correction_counts_of_an_independent_reference(tmp_path):
    """token_truncate: the first record's correction_truncated / correction_weight equal float64
    sums written here from the rollouts (truncated share of valid tokens, mean min(exp(old -
    rollout), C) over numerator tokens). Catches the planner's step statistics or the record's
    conversion (a missing key, a count from the wrong mask, per-rank instead of step sums)."""
    import math

    from megatron_pg_agg.data.rollout_files import write_rollouts
    from megatron_pg_agg.data.synthetic import synthetic_rollouts

    cap = 1.02
    steps = synthetic_rollouts(vocab_size=128, seed=1234)
    for rollouts in steps.values():
        for i, r in enumerate(rollouts):
            r.rollout_logprobs = [lp - 0.03 * ((i + j) % 3) for j, lp in enumerate(r.old_logprobs)]
    path = write_rollouts(tmp_path / "steps.jsonl", steps)
    metrics = tmp_path / "m.jsonl"
    rc, out, _ = run(torchrun(2, TRAIN, "--train-iters", 1, "--metrics-file", metrics, "--rollouts", path,
                              "--pg-rollout-correction", "token_truncate", "--pg-rollout-correction-max", cap),
                     300, "correction counts")
    assert rc == 0, out[-20000:]
    record = _records(metrics)[0][0]
    valid = truncated = numerator = 0
    weight_sum = 0.0
    for r in steps[record["rollout_step"]]:
        for j, d in enumerate(r.loss_mask):
            n = d if r.numerator_mask is None else r.numerator_mask[j] * d
            ratio = math.exp(r.old_logprobs[j] - r.rollout_logprobs[j])
            valid += d
            truncated += int(bool(d) and ratio > cap)
            numerator += n
            weight_sum += min(ratio, cap) if n else 0.0
    assert truncated > 0  # the case is exercised
    assert record["correction_truncated"] == pytest.approx(truncated / valid, rel=1e-9)
    assert record["correction_masked"] == 0.0
    assert record["correction_weight"] == pytest.approx(weight_sum / numerator, rel=1e-5)  # float32 inputs
