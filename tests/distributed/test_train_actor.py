"""The main job: launch/train_actor.py under torchrun, start-up refusals, and two loopback nodes."""
import json
import re
import sys

import pytest

from megatron_pg_agg.training.metrics import read_runs
from tests.support.launching import ROOT, child_env, finish, free_port, run, split_by_run, start, torchrun, worker
from tests.support.records import trainer_records

TRAIN = ROOT / "launch" / "train_actor.py"
REFERENCE = worker("trainer_reference")
RUNS = worker("trainer_runs")
MULTINODE = ROOT / "launch" / "multinode.sh"
FIELDS = ("objective", "weight", "clip_fraction", "kl", "entropy", "grad_norm", "tokens_per_s")


def _reference(tmp_path, checkpoint, step: int, flags: list, variants=None) -> dict:
    """The single-process float64 reference (workers/trainer_reference.py) of rollout step
    ``step`` at a checkpoint's weights (None: the initial ones)."""
    spec, out = tmp_path / "reference.spec.json", tmp_path / "reference.json"
    spec.write_text(json.dumps({"checkpoint": checkpoint and str(checkpoint), "step": step,
                                "flags": list(map(str, flags)), "variants": variants or {"": []}}))
    rc, log, _ = run([sys.executable, *REFERENCE, str(spec), str(out)], 300, "trainer reference", env=child_env())
    assert rc == 0, log[-10000:]
    return json.loads(out.read_text())


def test_main_job_trains_logs_every_step_and_writes_metrics(tmp_path):
    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    # --save only adds checkpoints (at 10 and 20): the training is the main job's
    # the README's command as a user runs it: a fresh torchrun
    rc, out, elapsed = run(torchrun(2, TRAIN, "--rollouts", "synthetic", "--metrics-file", metrics, "--save", ckpt,
                                    "--save-interval", 10),
                           300, "main job", fresh=True)
    assert rc == 0, out[-20000:]
    progress = [line for line in out.splitlines() if line.startswith("[train] [")]
    assert len(progress) == 20, out[-5000:]
    for line in progress:
        for field in FIELDS:
            assert f"{field}=" in line, (field, line)
    steps, final = trainer_records(metrics)
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
    reference = _reference(tmp_path, ckpt / "iter_0000010" / "rank_00000.pt", steps[10]["rollout_step"], [])
    ref, got = reference["variants"][""], steps[10]
    assert reference["iteration"] == 10 and got["iteration"] == 11
    assert got["weight"] == ref["weight"]
    obj_err = abs(got["objective"] - ref["objective"]) / abs(ref["objective"])
    norm_err = abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
    assert obj_err <= 2e-6 and norm_err <= 1e-5, (obj_err, norm_err, got, ref)  # float32 sums vs float64
    print(f"main job: {elapsed:.1f}s; iteration 11 vs reference: objective {obj_err:.1e}, grad_norm {norm_err:.1e}")


ONLINE_FIELDS = ("accuracy", "response_length", "length_correct", "length_incorrect", "truncated", "responses",
                 "objective", "objective_first", "weight", "clip_fraction", "entropy", "grad_norm", "sample_s",
                 "iteration_s", "rollout_step", "skipped")
"""What an online record holds besides the offline record's fields (docs/flags.md, "Records")."""


def test_the_main_job_learns_the_reach_task_online(tmp_path):
    """The main job with no flags (README command 1: online GRPO on the reach task, seed 1234, 20
    iterations of 64 prompts x 8 samples, 4 updates each) against a control that cannot learn
    (--lr 0: the same warm-up, then the RL updates move nothing; one update per batch, which at
    lr 0 changes nothing but the time), in one launch (workers/trainer_runs.py, the command line's
    own ``main``). The independent reference is the control: both start from the same warm-up
    and sample the same first batch (identical first record), and over the same 20 iterations the
    control's accuracy stays where it started while the real run's rises by more than 0.3
    (measured on this seed: 0.12 -> 0.64 over the first and last 3 iterations; the control moves
    by sampling noise, about 0.01). Catches an RL phase that does not train (a zeroed advantage
    or learning rate, updates on a stale batch, a sign error: accuracy falls) and a warm-up
    passed off as learning."""
    runs = [{"name": "default", "argv": ["--metrics-file", str(tmp_path / "default.jsonl")]},
            {"name": "lr0", "argv": ["--lr", "0", "--updates-per-batch", "1",
                                     "--metrics-file", str(tmp_path / "lr0.jsonl")]}]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    rc, out, elapsed = run(torchrun(2, *RUNS, tmp_path / "runs.json", tmp_path / "status.json"), 400, "online runs")
    assert rc == 0 and json.loads((tmp_path / "status.json").read_text()) == {"default": 0, "lr0": 0}, out[-20000:]
    log = split_by_run(out)["default"]
    start_line = next(line for line in log.splitlines() if "world=2" in line)
    assert ("mode=token_mean online GRPO on the reach task: 64 prompts x 8 samples per iteration, 4 updates each"
            in start_line and "steps=" not in start_line), start_line
    assert "[train] warm-up: 60 supervised steps" in log and "[train] warm-up done in" in log
    progress = [line for line in log.splitlines() if line.startswith("[train] [")]
    assert len(progress) == 20 and all("accuracy=" in p and "response_length=" in p for p in progress), log[-5000:]
    (online_run,) = read_runs(str(tmp_path / "default.jsonl"))
    assert online_run.starts[0]["online"]["prompts_per_step"] == 64 and online_run.starts[0]["mode"] == "token_mean"
    curves = {}
    for name in ("default", "lr0"):
        steps, final = trainer_records(tmp_path / f"{name}.jsonl")
        assert [r["iteration"] for r in steps] == list(range(1, 21)) and final[0]["iteration"] == 20, name
        assert [r["rollout_step"] for r in steps] == list(range(20)), name
        for r in steps:
            missing = [k for k in ONLINE_FIELDS if k not in r]
            assert not missing and r["responses"] == 64 * 8 and not r["skipped"], (name, missing)
            assert 1 <= r["response_length"] <= 32 and r["weight"] == r["valid_tokens"] > 0, (name, r)
        curves[name] = [r["accuracy"] for r in steps]
    first = {name: trainer_records(tmp_path / f"{name}.jsonl")[0][0] for name in curves}
    for key in ("accuracy", "response_length", "length_incorrect", "objective_first"):
        assert first["default"][key] == first["lr0"][key], key  # the same warm start and first batch

    def gain(curve):
        return sum(curve[-3:]) / 3 - sum(curve[:3]) / 3

    assert gain(curves["default"]) > 0.3, curves["default"]
    assert abs(gain(curves["lr0"])) < 0.05, curves["lr0"]
    print(f"online runs: {elapsed:.0f} s; accuracy {curves['default'][0]:.3f} -> {curves['default'][-1]:.3f}, "
          f"control (lr 0) {curves['lr0'][0]:.3f} -> {curves['lr0'][-1]:.3f}")


# name -> (argv, environment, words the refusal must contain): each exits 2 before any process group
REFUSALS = {
    "constant-without-divisor": (["--pg-loss-aggregation", "constant"], {}, ["--pg-loss-aggregation-divisor"]),
    "divisor-without-constant": (["--pg-loss-aggregation-divisor", "8"], {}, ["constant"]),
    "tp-not-dividing-world": (["--tensor-model-parallel-size", "2"], {"WORLD_SIZE": "3"},
                              ["not divisible", "TP x PP x CP"]),
    "pp-not-dividing-layers": (["--pipeline-model-parallel-size", "3"], {"WORLD_SIZE": "3"},
                               ["--num-layers 2", "not divisible"]),
    "interleaved-batch-p2p": (["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                               "--num-layers-per-virtual-pipeline-stage", "1", "--batch-p2p-comm"],
                              {"WORLD_SIZE": "2"}, ["interleaved", "--batch-p2p-comm"]),
    "no-per-token-loss": (["--no-calculate-per-token-loss"], {}, ["calculate_per_token_loss"]),
    "sequence-parallel-on-cpu": (["--sequence-parallel", "--tensor-model-parallel-size", "2"], {"WORLD_SIZE": "2"},
                                 ["--sequence-parallel needs Transformer Engine", "run on a GPU"]),
    "context-parallel-on-cpu": (["--context-parallel-size", "2"], {"WORLD_SIZE": "2"},
                                ["--context-parallel-size > 1 needs Transformer Engine's THD attention (GPU)"]),
    "fp16": (["--fp16"], {}, ["--fp16 is not supported", "loss scale", "use --bf16"]),
    "param-gather-without-sharding": (["--overlap-param-gather", "--overlap-grad-reduce"], {},
                                      ["--overlap-param-gather needs --use-distributed-optimizer"]),
    "missing-rollout-file": (["--rollouts", "/nonexistent/steps.jsonl"], {}, ["no such file"]),
    # the built-in rollouts carry no rollout_logprobs
    "correction-without-rollout-logprobs": (["--rollouts", "synthetic", "--pg-rollout-correction", "token_truncate"],
                                            {}, ["rollout_logprobs is missing", "--pg-rollout-correction"]),
    "correction-bounds-crossed": (["--pg-rollout-correction", "token_mask", "--pg-rollout-correction-max", "0.5",
                                   "--pg-rollout-correction-min", "0.8"], {}, ["C > c"]),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    """{name: (exit status, its output)} of every REFUSALS start, one after another through the
    command line's ``main`` in one process (workers/trainer_runs.py; importing megatron-core is
    most of a start's cost). No torchrun: a run the checks let through would wait for its peers
    in init_process_group, and the launch would time out."""
    tmp = tmp_path_factory.mktemp("refusals")
    spec, result = tmp / "runs.json", tmp / "result.json"
    spec.write_text(json.dumps([{"name": name, "argv": [*argv, "--metrics-file", str(tmp / f"{name}.jsonl")],
                                 "env": env} for name, (argv, env, _) in REFUSALS.items()]))
    rc, out, _ = run([sys.executable, *RUNS, spec, result], 240, "refused starts", env=child_env())
    assert rc == 0 and result.exists(), out[-20000:]
    status, parts = json.loads(result.read_text()), split_by_run(out)
    return {name: (status[name], parts[name]) for name in REFUSALS}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_invalid_runs_are_refused_before_any_process_group(refusals, name):
    status, out = refusals[name]
    assert status == 2, out[-5000:]
    for word in REFUSALS[name][2]:
        assert word in out, (word, out[-3000:])
    assert "world=" not in out  # the run never started


def test_a_refusal_under_torchrun_is_printed_once_and_every_rank_exits_2(tmp_path):
    """Two ranks refuse the same flags: the project's line appears once (rank 0 speaks), both
    ranks exit 2, and what the shell sees is torchrun's own status 1 and its report, as
    docs/failure-modes.md says. A real torchrun (fresh): its report is what is checked. Catches
    the refusal logged on every rank again, or a rank exiting with another status (each rank's own
    status 2 without torchrun: test_invalid_runs_are_refused_before_any_process_group)."""
    rc, out, _ = run(torchrun(2, TRAIN, "--fp16", "--metrics-file", tmp_path / "m.jsonl"),
                     240, "refused under torchrun", fresh=True)
    assert rc == 1, out[-5000:]
    assert out.count("[train] refusing to start:") == 1, out[-5000:]
    # torchrun reports the first rank to exit (2) and may stop the other before it exits on its own
    # (SIGTERM, -15): every status it reports is one of these
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    assert "ChildFailedError" in out and "2" in codes and set(codes) <= {"2", "-15"}, out[-5000:]
    assert not (tmp_path / "m.jsonl").exists()


def test_two_loopback_nodes_train_like_one_node(tmp_path):
    one = tmp_path / "one.jsonl"
    rc, out, _ = run(torchrun(2, TRAIN, "--rollouts", "synthetic", "--train-iters", 6, "--metrics-file", one), 300,
                     "one node")
    assert rc == 0, out[-20000:]
    port = free_port()
    two = tmp_path / "two.jsonl"
    nodes = []
    for node_rank in (0, 1):
        env = child_env(NNODES="2", NODE_RANK=str(node_rank), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), NPROC_PER_NODE="1", PYTHON=sys.executable)
        nodes.append(start(["bash", str(MULTINODE), "--rollouts", "synthetic", "--train-iters", "6", "--metrics-file",
                            two], env=env))
    outputs = [finish(p, 300, f"node {i}") for i, p in enumerate(nodes)]
    for rc, out in outputs:
        assert rc == 0, out[-20000:]
    assert "node 1/2" in outputs[1][1] and "world=2" in outputs[0][1]
    a, fa = trainer_records(one)
    b, fb = trainer_records(two)
    assert [r["objective"] for r in a] == [r["objective"] for r in b]
    assert fa[0]["param_checksum"] == fb[0]["param_checksum"]


def test_training_from_a_rollout_file_matches_the_built_in_data(tmp_path):
    """--rollouts: the built-in set written to JSONL and read back trains bit for bit the same."""
    from megatron_pg_agg.data.rollout_files import write_rollouts
    from megatron_pg_agg.data.synthetic import synthetic_rollouts

    path = write_rollouts(tmp_path / "steps.jsonl", synthetic_rollouts(vocab_size=128, seed=1234))
    runs = {}
    for name, extra in (("builtin", ["--rollouts", "synthetic"]), ("file", ["--rollouts", path])):
        metrics = tmp_path / f"{name}.jsonl"
        rc, out, _ = run(torchrun(2, TRAIN, "--train-iters", 3, "--metrics-file", metrics, *extra), 300, name)
        assert rc == 0, out[-20000:]
        runs[name] = trainer_records(metrics)
    assert [r["objective"] for r in runs["builtin"][0]] == [r["objective"] for r in runs["file"][0]]
    assert runs["builtin"][1][0]["param_checksum"] == runs["file"][1][0]["param_checksum"]


# Every mode x policy loss (the three KL estimators in turn), and every rollout correction: one
# iteration each from the same initial weights, in one launch (workers/trainer_runs.py)
EPS_LOW, EPS_HIGH, KL_COEF, ENTROPY_COEF, DIVISOR, LR = 0.2, 0.28, 0.05, 0.01, 32.0, 1e-3
LOSS_FLAGS = ["--pg-clip-eps", EPS_LOW, "--pg-clip-eps-high", EPS_HIGH, "--pg-kl-coef", KL_COEF,
              "--pg-entropy-coef", ENTROPY_COEF, "--lr", LR]
CORRECTIONS = {"token_truncate": (1.02, 0.0), "token_mask": (1.02, 0.97), "sequence_truncate": (1.01, 0.0),
               "sequence_mask": (1.01, 0.99)}


def _loss_variants() -> dict:
    """{name: (flags, LossNumbers)} of every run of the every-field test."""
    from megatron_pg_agg.core.losses import KL_ESTIMATORS, POLICY_LOSSES
    from megatron_pg_agg.core.modes import MODES
    from tests.support.reference import LossNumbers

    out = {}
    common = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, kl_coef=KL_COEF, entropy_coef=ENTROPY_COEF)
    for i, (mode, policy) in enumerate((m, p) for m in MODES for p in POLICY_LOSSES):
        estimator = KL_ESTIMATORS[i % len(KL_ESTIMATORS)]
        divisor = DIVISOR if mode == "constant" else None
        flags = ["--pg-loss-aggregation", mode, "--pg-policy-loss", policy, "--pg-kl-estimator", estimator,
                 *(["--pg-loss-aggregation-divisor", divisor] if divisor else [])]
        out[f"{mode}-{policy}-{estimator}"] = (flags, LossNumbers(mode=mode, policy=policy, estimator=estimator,
                                                                  divisor=divisor, **common))
    for kind, (cap, floor) in CORRECTIONS.items():
        flags = ["--pg-loss-aggregation", "seq_mean", "--pg-rollout-correction", kind,
                 "--pg-rollout-correction-max", cap, "--pg-rollout-correction-min", floor]
        out[f"seq_mean-ppo-{kind}"] = (flags, LossNumbers(mode="seq_mean", correction=(kind, cap, floor), **common))
    return out


def test_every_recorded_field_of_every_mode_and_policy_loss_equals_the_float64_reference(tmp_path):
    """DP=2 (2 microbatches per rank), iteration 1 of every mode x policy loss (each KL estimator
    in turn) and of every rollout correction: each field of the metrics record against float64
    values computed here from the rollouts (tests/support/reference.reference_record) and the
    current policy's per-token log-probs and entropies from the reference worker (one process,
    the same initial weights, every response alone): objective, pg_loss, clip_fraction, ratio,
    kl, entropy, weight, valid_tokens and the correction counts to 1e-5 relative, grad_norm
    against autograd of the worker's float64 objective, and rollout_step, skipped,
    skipped_total and learning_rate exactly. What it catches in the entry: a record built from
    another step's plan or from one rank's pairs, a pair reduced over TP or DP twice, a report
    key converted with the wrong count, an estimator or clip flag not reaching the loss, a
    correction count from the wrong mask, the learning rate of another step."""
    from megatron_pg_agg.data.rollout_files import write_rollouts
    from megatron_pg_agg.data.synthetic import synthetic_rollouts
    from tests.support.reference import reference_record
    from tests.support.rollouts import with_engine_logprobs

    variants = _loss_variants()
    steps = with_engine_logprobs(synthetic_rollouts(vocab_size=128, seed=1234))
    rollout_file = write_rollouts(tmp_path / "steps.jsonl", steps)
    runs = [{"name": name, "argv": list(map(str, [*LOSS_FLAGS, *flags, "--train-iters", 1, "--rollouts", rollout_file,
                                                  "--metrics-file", tmp_path / f"{name}.jsonl"]))}
            for name, (flags, _) in variants.items()]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    rc, out, _ = run(torchrun(2, *RUNS, tmp_path / "runs.json", tmp_path / "status.json"), 600, "trainer runs")
    assert rc == 0 and json.loads((tmp_path / "status.json").read_text()) == {n: 0 for n in variants}, out[-20000:]
    # the reference forwards the built-in set: the same ids, without the engine's log-probs
    # (which only the corrections read, and reference_record reads from `steps`)
    plain = {name: [str(f) for f in flags] for name, (flags, numbers) in variants.items() if numbers.correction is None}
    ref = _reference(tmp_path, None, 0, LOSS_FLAGS, plain)
    rollouts = steps[0]
    assert len(ref["tokens"]) == len(rollouts)
    current = [(logp, entropy) for logp, entropy in ref["tokens"]]
    worst = {}
    for name, (_, numbers) in variants.items():
        (record,), _ = trainer_records(tmp_path / f"{name}.jsonl")
        want = reference_record(rollouts, current, numbers)
        counters = (record["iteration"], record["rollout_step"], record["skipped"], record["skipped_total"])
        assert counters == (1, 0, False, 0), name
        assert record["learning_rate"] == LR, name
        assert (record["weight"], record["valid_tokens"]) == (want["weight"], want["valid_tokens"]), name
        for key, value in want.items():
            if key in ("weight", "valid_tokens"):
                continue
            # pg_loss and objective are float32 sums of per-token terms of size ~0.1-1 that cancel
            # to ~1e-3 here: their rounding scales with the terms, so the error is taken
            # against at least 0.01 (a factor 1.01 on the smallest, 6e-4, is still 60x over)
            floor = 0.01 if key in ("objective", "pg_loss") else 1e-6
            err = abs(record[key] - value) / max(abs(value), floor)
            worst[key] = max(worst.get(key, 0.0), err)
            assert err <= 1e-5, (name, key, record[key], value)
        if name in ref["variants"]:
            autograd = ref["variants"][name]
            assert autograd["weight"] == record["weight"], name
            assert abs(autograd["objective"] - want["objective"]) <= 1e-9 * max(abs(want["objective"]), 1e-6), name
            err = abs(record["grad_norm"] - autograd["grad_norm"]) / autograd["grad_norm"]
            worst["grad_norm"] = max(worst.get("grad_norm", 0.0), err)
            assert err <= 1e-5, (name, record["grad_norm"], autograd["grad_norm"])
    # the options act on this data: the corrections change something, the clip binds
    for kind in CORRECTIONS:
        (record,), _ = trainer_records(tmp_path / f"seq_mean-ppo-{kind}.jsonl")
        assert record["correction_masked" if kind.endswith("mask") else "correction_truncated"] > 0, kind
    print("worst relative error per field over", len(variants), "runs:", {k: f"{v:.1e}" for k, v in worst.items()})
