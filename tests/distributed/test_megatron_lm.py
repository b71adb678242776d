"""The actor inside Megatron-LM's own training loop: launch/pretrain_actor.py on a real checkout.

The checkout is ``$MEGATRON_LM_PATH`` or ``../shared/third_party/Megatron-LM`` (core_v0.16.1).
Without one these tests skip with that reason; with ``MEGATRON_PG_AGG_REQUIRE_MEGATRON_LM=1``
(.ci/run sets it) the skip is a failure. Launches are batched: one process (or one torchrun
launch) runs every mode of a layout through the entry point's ``main`` in turn
(tests/distributed/workers/megatron_lm_runs.py), because importing megatron.training costs ~10 s per process.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from megatron_pg_agg.versions import in_range, installed_megatron_core_version
from tests.support.launching import ROOT, finish, kill_launch, launch_command, run, split_by_run, start, worker
from tests.support.reference import reference_record

SCRIPT = ROOT / "launch" / "pretrain_actor.py"
RUNS = worker("megatron_lm_runs")
REFERENCE = worker("megatron_lm_reference")

# A tiny GPT in Megatron-LM's own flags. 24 responses of 4-28 tokens in 6 prompt groups per
# rollout step (the built-in synthetic set, 4 steps); 4 packed rows of <= 256 tokens per step.
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "256", "--max-position-embeddings", "256",
    "--micro-batch-size", "1", "--global-batch-size", "4",
    "--lr", "1e-3", "--min-lr", "1e-3", "--lr-decay-style", "constant",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--make-vocab-size-divisible-by", "64",
    "--distributed-backend", "gloo", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    # torch.compile'd fusions cost ~30 s of compilation on CPU: off in tests
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion",
    "--use-cpu-initialization", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--seed", "1234",
]
KL_COEF, ENTROPY_COEF, EPS_LOW, EPS_HIGH, DIVISOR = 0.01, 0.001, 0.2, 0.28, 32.0
LOSS = ["--calculate-per-token-loss", "--pg-kl-coef", str(KL_COEF), "--pg-entropy-coef", str(ENTROPY_COEF),
        "--pg-clip-eps", str(EPS_LOW), "--pg-clip-eps-high", str(EPS_HIGH)]
MODES = {
    "token_mean": [], "seq_mean": [], "prompt_mean": [],
    "constant": ["--pg-loss-aggregation-divisor", str(DIVISOR)],
}
ITERS = 4
# SGD for the layout comparison: Adam's first update is lr * g / (|g| + eps), so a gradient entry
# near 0 flips sign on float noise between layouts and later iterations differ at 1e-5 for no
# reason of ours; SGD carries the 1e-7 differences on unamplified. (Resume is tested with Adam.)
LAYOUT_OPTIMIZER = ["--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.05"]
# The configuration large models train with (fp32 here: bf16 is measured in the trainer's
# tests/distributed/test_production_config.py): Megatron-LM's own flags, its own handling (sync
# functions, the gather before its checkpoints); buckets small enough for several bucket groups
PRODUCTION = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
              "--ddp-bucket-size", "4000"]
# megatron-core's distributed optimizer takes Adam only: those layouts run Adam, and beside each
# mode a twin without the production flags (same layout, plain DDP, Adam) that every iteration is
# compared with; their first iteration (before any update) is compared with DP1x4mb as the others
ADAM = ["--optimizer", "adam", "--lr", "1e-3", "--min-lr", "1e-3"]
PLAIN_TWIN = "plain-adam-"
# name -> (processes, flags); DP=2 cuts each step into 2 microbatches per rank, the others 4
LAYOUTS = {
    "DP1x4mb": (1, []),
    "DP2": (2, []),
    "TP2": (2, ["--tensor-model-parallel-size", "2"]),
    "PP2": (2, ["--pipeline-model-parallel-size", "2"]),
    "DP2-dist-opt-overlaps": (2, [*ADAM, *PRODUCTION]),
    "PP2-dist-opt-overlaps": (2, ["--pipeline-model-parallel-size", "2", *ADAM, *PRODUCTION]),
}
LAUNCH_S = 240
TENSORBOARD_RUN = ("DP2", "prompt_mean")
MTP_TENSORBOARD_RUN = ("DP2", "mtp-seq_mean")
# Multi-token prediction (megatron-core 0.16+; 0.15 refuses it): one iteration per mode and layout
MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3", "--position-embedding-type", "rope",
       "--untie-embeddings-and-output-weights"]
MTP_RELEASE = in_range(installed_megatron_core_version(), ">=0.16")


@pytest.fixture(scope="module")
def checkout(megatron_lm_checkout) -> Path:
    return megatron_lm_checkout


def _records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _batch(tmp: Path, name: str, nproc: int, runs: list) -> tuple[dict, str]:
    """Run ``runs`` ({name, argv}) in one launch; returns ({run: exit status}, output)."""
    spec, result = tmp / f"{name}.runs.json", tmp / f"{name}.result.json"
    spec.write_text(json.dumps(runs))
    rc, out, _ = run(launch_command(nproc, RUNS, spec, result), LAUNCH_S, f"Megatron-LM runs {name}")
    assert rc == 0 and result.exists(), out[-20000:]
    return json.loads(result.read_text()), out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _objective_rel(ours: dict, ref: dict) -> float:
    """Relative error of the objective against the size of its parts: J = pg + kl_coef * kl -
    entropy_coef * entropy is a float32 sum whose terms may cancel (J near 0 at some iterations:
    pg 0.0043 against an entropy term of -0.0048), so its rounding error scales with
    |pg| + kl_coef |kl| + entropy_coef |entropy|, not with |J|; and pg itself is a sum of per-token
    terms of size |A| ~ 1 that may cancel (pg 0.00083 at TP2's iteration 2, off DP1's by 6e-9 on one
    2-core machine), so the scale is at least 0.01, the floor of the project's max(|J|, 0.01)."""
    scale = abs(ref["pg_loss"]) + KL_COEF * abs(ref["kl"]) + ENTROPY_COEF * abs(ref["entropy"])
    return abs(ours["objective"] - ref["objective"]) / max(abs(ref["objective"]), scale, 0.01)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("megatron_lm")


@pytest.fixture(scope="module")
def initial_checkpoint(checkout, work) -> Path:
    """One iteration of the real entry script (1 process) saved with Megatron-LM's ``--save``
    (its default torch_dist format): the common initial weights of every run below (with PP the
    seeds differ per stage, so fresh initialisations would differ across layouts)."""
    ckpt = work / "init"
    rc, out, _ = run(launch_command(1, SCRIPT, "--megatron-lm", checkout, *TINY, *LOSS, "--train-iters", 1,
                              "--save", ckpt, "--save-interval", 1), LAUNCH_S, "initial checkpoint")
    assert rc == 0, out[-20000:]
    assert "[pg] iteration 1/1 | objective " in out, out[-5000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    return ckpt


@pytest.fixture(scope="module")
def mtp_initial_checkpoint(checkout, work) -> Optional[Path]:
    """As ``initial_checkpoint``, for a model with a 2-depth MTP block (None on 0.15)."""
    if not MTP_RELEASE:
        return None
    ckpt = work / "mtp_init"
    rc, out, _ = run(launch_command(1, SCRIPT, "--megatron-lm", checkout, *TINY, *LOSS, *MTP, "--train-iters", 1,
                              "--save", ckpt, "--save-interval", 1), LAUNCH_S, "MTP initial checkpoint")
    assert rc == 0, out[-20000:]
    assert "[pg] iteration 1/1 | objective " in out and "| mtp_loss " in out, out[-5000:]
    return ckpt


@pytest.fixture(scope="module")
def layout_runs(checkout, work, initial_checkpoint, mtp_initial_checkpoint) -> dict:
    """{(layout, mode): per-iteration records}: every mode under every layout, from the same
    initial weights (``--load ... --finetune``: weights only, iteration 0, fresh optimizer);
    with MTP (0.16+) also ``(layout, "mtp-" + mode)``: one iteration of the MTP model."""
    records = {}
    for layout, (nproc, flags) in LAYOUTS.items():
        runs = []
        for mode, extra in (MODES.items() if mtp_initial_checkpoint else ()):
            if (layout, f"mtp-{mode}") == MTP_TENSORBOARD_RUN:
                extra = [*extra, "--tensorboard-dir", str(work / "tensorboard_mtp")]
            runs.append({"name": f"mtp-{mode}", "argv": [
                "--megatron-lm", str(checkout), *TINY, *LOSS, *MTP, *LAYOUT_OPTIMIZER, *flags,
                "--train-iters", "1", "--load", str(mtp_initial_checkpoint), "--finetune",
                "--pg-loss-aggregation", mode, *extra,
                "--pg-metrics-file", str(work / f"{layout}_mtp-{mode}.jsonl")]})
        twin = [f for f in flags if f not in PRODUCTION] if PRODUCTION[0] in flags else None
        for name, mode, extra, layout_flags in [(m, m, e, flags) for m, e in MODES.items()] + (
                [(PLAIN_TWIN + m, m, e, twin) for m, e in MODES.items()] if twin else []):
            metrics = work / f"{layout}_{name}.jsonl"
            if (layout, mode) == TENSORBOARD_RUN:
                extra = [*extra, "--tensorboard-dir", str(work / "tensorboard")]
            runs.append({"name": name, "argv": [
                "--megatron-lm", str(checkout), *TINY, *LOSS, *LAYOUT_OPTIMIZER, *layout_flags,
                "--train-iters", str(ITERS),
                "--load", str(initial_checkpoint), "--finetune",
                "--pg-loss-aggregation", mode, *extra, "--pg-metrics-file", str(metrics)]})
        status, out = _batch(work, layout, nproc, runs)
        assert status == {run["name"]: 0 for run in runs}, out[-20000:]
        for run_spec in runs:
            records[layout, run_spec["name"]] = _records(work / f"{layout}_{run_spec['name']}.jsonl")
    return records


def test_every_layout_gives_the_same_objective_and_grad_norm(layout_runs):
    """DP=2 (2 microbatches per rank), TP=2, PP=2, DP=2 and PP=2 with Megatron-LM's
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather, and one rank with 4
    microbatches: the same per-iteration objective, weight and grad norm in every mode (the
    overlapped layouts also catch a bucket reduced before its last microbatch and a step on stale
    parameter shards). Catches any split-dependent
    normalisation: a per-microbatch or per-rank weight, a missing --calculate-per-token-loss
    contract, a TP-duplicated or PP-dropped report."""
    for mode in MODES:
        for layout in LAYOUTS:
            twin = layout_runs.get((layout, PLAIN_TWIN + mode))
            base = layout_runs["DP1x4mb", mode] if twin is None else layout_runs["DP1x4mb", mode][:1] + twin[1:]
            assert [r["iteration"] for r in base] == list(range(1, ITERS + 1))
            got = layout_runs[layout, mode]
            assert [r["iteration"] for r in got] == list(range(1, ITERS + 1)), (layout, mode)
            for ours, ref in zip(got, base):
                where = (layout, mode, ours["iteration"])
                assert ours["weight"] == ref["weight"] > 0, where
                assert ours["rollout_step"] == ref["rollout_step"] == (ours["iteration"] - 1) % 4, where
                assert _objective_rel(ours, ref) <= 1e-6, (where, ours, ref)
                assert _rel(ours["grad_norm"], ref["grad_norm"]) <= 1e-6, (where, ours, ref)
                for key in ("kl", "entropy", "clip_fraction"):
                    assert _rel(ours[key], ref[key]) <= 1e-5, (where, key)


def test_mtp_is_exact_across_layouts_in_every_mode(checkout, work, layout_runs):
    """With a 2-depth MTP block (megatron-core 0.16+): DP=2, TP=2, PP=2 (MTP on the last stage)
    and one rank with 4 microbatches give the same first step in every mode, objective and grad
    norm (MTP parameters included) to 1e-6, and the same ``mtp_loss`` pair, whose count is the
    step's valid tokens D in every mode (its normaliser is D, not W). On 0.15, which asserts MTP
    on packed sequences, the real script refuses --mtp-num-layers with that reason (exit 2).
    The MTP gradient against Megatron's own token-mean run: tests/unit/megatron/test_mtp.py."""
    if not MTP_RELEASE:
        rc, out, _ = run(launch_command(1, SCRIPT, "--megatron-lm", checkout, *TINY, *LOSS, *MTP, "--train-iters", 1),
                         LAUNCH_S, "MTP on 0.15")
        assert rc == 2 and "refuses multi-token prediction with packed sequences" in out, out[-5000:]
        return
    worst = {}
    for mode in MODES:
        base = layout_runs["DP1x4mb", f"mtp-{mode}"][0]
        total, count = base["mtp_loss"]
        assert count == base["valid_tokens"] > 0 and 3.0 < total / count < 6.0, base  # ~ln(128) untrained
        for layout in LAYOUTS:
            (got,) = layout_runs[layout, f"mtp-{mode}"]
            assert got["weight"] == base["weight"] and got["mtp_loss"][1] == count, (layout, mode)
            for key, value, ref in (("objective", got["objective"], base["objective"]),
                                    ("grad_norm", got["grad_norm"], base["grad_norm"]),
                                    ("mtp_loss", got["mtp_loss"][0] / count, total / count)):
                worst[key] = max(worst.get(key, 0.0), _rel(value, ref))
                assert _rel(value, ref) <= 1e-6, (layout, mode, key, value, ref)
        assert _rel(total, layout_runs["DP1x4mb", "mtp-token_mean"][0]["mtp_loss"][0]) <= 1e-6, mode
    print("MTP, worst relative difference to 1 rank x 4 microbatches:", {k: f"{v:.1e}" for k, v in worst.items()})
    # TensorBoard: Megatron-LM's own writer holds pg/mtp_loss, the record's sum / count
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(work / "tensorboard_mtp"))
    events.Reload()
    (record,) = layout_runs[MTP_TENSORBOARD_RUN]
    scalars = {e.step: e.value for e in events.Scalars("pg/mtp_loss")}
    assert scalars == {1: pytest.approx(record["mtp_loss"][0] / record["mtp_loss"][1], rel=1e-6)}, scalars


def test_the_flag_changes_the_objective(layout_runs):
    """The flag takes effect: different modes give different objectives, weights and updates."""
    first = {mode: layout_runs["DP2", mode][0] for mode in MODES}
    assert first["token_mean"]["weight"] > first["seq_mean"]["weight"] > first["prompt_mean"]["weight"]
    assert first["seq_mean"]["weight"] == first["constant"]["weight"]
    for a, b in (("token_mean", "prompt_mean"), ("token_mean", "seq_mean"), ("seq_mean", "prompt_mean"),
                 ("seq_mean", "constant")):
        assert _rel(first[a]["objective"], first[b]["objective"]) > 1e-3, (a, b)
        assert _rel(first[a]["grad_norm"], first[b]["grad_norm"]) > 1e-3, (a, b)


def test_tensorboard_gets_the_step_values_through_megatron_lms_writer(work, layout_runs):
    """With --tensorboard-dir, Megatron-LM's own writer (on the last rank) holds the objective,
    weight, clip fraction, KL and entropy of every iteration, negative objectives included."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(work / "tensorboard"))
    events.Reload()
    records = layout_runs[TENSORBOARD_RUN]
    for key in ("objective", "weight", "clip_fraction", "kl", "entropy"):
        scalars = {e.step: e.value for e in events.Scalars(f"pg/{key}")}
        assert sorted(scalars) == [r["iteration"] for r in records], key
        for r in records:
            assert scalars[r["iteration"]] == pytest.approx(r[key], rel=1e-6), (key, r["iteration"])
    assert any(r["objective"] < 0 for r in records)  # what Megatron-LM's console line drops


@pytest.fixture(scope="module")
def reference_tokens(checkout, work, initial_checkpoint) -> list:
    """Per rollout of step 0, the initial weights' ``(log-probs, entropies)`` of its response
    tokens: Megatron-LM's own loader, one process, every response forwarded alone, float64
    (tests/distributed/workers/megatron_lm_reference.py: no package loss or planning code)."""
    out_path = work / "reference.json"
    rc, out, _ = run([sys.executable, *REFERENCE, str(checkout), str(out_path), "--", *TINY, *LOSS,
                      "--load", str(initial_checkpoint), "--finetune"], LAUNCH_S, "reference")
    assert rc == 0, out[-20000:]
    return [tuple(t) for t in json.loads(out_path.read_text())["tokens"]]


def _rollouts(step: int = 0) -> list:
    from megatron_pg_agg.data.synthetic import synthetic_rollouts

    return synthetic_rollouts(vocab_size=127, seed=1234)[step]


def _numbers(mode: str, policy: str = "ppo", estimator: str = "k3", correction=None):
    from tests.support.reference import LossNumbers

    return LossNumbers(mode=mode, policy=policy, estimator=estimator, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                       divisor=DIVISOR if mode == "constant" else None, kl_coef=KL_COEF,
                       entropy_coef=ENTROPY_COEF, correction=correction)


def _assert_record_is_the_reference(record: dict, want: dict, where) -> dict:
    """Every number of ``want`` (reference_record) in the record: W and valid tokens exactly, the
    rest to 1e-6 relative (objective and pg_loss against at least 0.01: float32 sums of per-token
    terms of size ~0.1-1 that cancel to ~1e-3, so a factor 1.01 still fails by far). Returns the
    relative errors."""
    assert (record["weight"], record["valid_tokens"]) == (want["weight"], want["valid_tokens"]), where
    errors = {}
    for key, value in want.items():
        if key in ("weight", "valid_tokens"):
            continue
        floor = 0.01 if key in ("objective", "pg_loss") else 1e-6
        errors[key] = abs(record[key] - value) / max(abs(value), floor)
        assert errors[key] <= 1e-5, (where, key, record[key], value)
    return errors


def test_first_step_records_the_independent_single_process_reference(layout_runs, reference_tokens):
    """Iteration 1 of every mode under every layout: each recorded number (objective, pg_loss,
    clip_fraction, ratio, kl, entropy, weight, valid_tokens) equals float64 values computed here
    from the rollouts and the reference's per-token terms (tests/support/reference.py)."""
    rollouts = _rollouts()
    assert len(reference_tokens) == len(rollouts) == 24 and len({r.group_id for r in rollouts}) == 6
    for mode in MODES:
        want = reference_record(rollouts, reference_tokens, _numbers(mode))
        for layout in LAYOUTS:
            _assert_record_is_the_reference(layout_runs[layout, mode][0], want, (layout, mode))


def test_every_record_is_of_the_step_that_ran(layout_runs):
    """Every iteration of every layout and mode logs the W and valid-token count of the rollout
    step it trained on (iteration i: step (i - 1) mod 4, counted here from the masks and groups),
    Megatron-LM's learning rate of the run (constant: 0.05, Adam's 1e-3 on the distributed
    optimizer's layouts) and no skip. Catches a record made
    from the next (or previous) step's plan, and a weight of one rank or microbatch."""
    from tests.support.reference import reference_weight

    steps = {k: _rollouts(k) for k in range(4)}
    assert len({reference_weight(steps[k], "token_mean") for k in steps}) == 4  # an off-by-one shows
    for (layout, name), records in layout_runs.items():
        mode = name.removeprefix("mtp-").removeprefix(PLAIN_TWIN)
        lr = 1e-3 if ADAM[1] in LAYOUTS[layout][1] else 0.05  # the distributed optimizer's layouts: Adam
        for r in records:
            step = (r["iteration"] - 1) % 4
            assert r["rollout_step"] == step, (layout, mode, r)
            assert (r["weight"], r["valid_tokens"]) == reference_weight(steps[step], mode), (layout, mode, r)
            assert r["learning_rate"] == lr and r["skipped"] is False, (layout, mode, r)


def _policy_variants() -> dict:
    """{name: (flags, LossNumbers)}: every mode x gspo/gmpo/cispo (each KL estimator in turn),
    ppo with k1 and k2, and ppo with every rollout correction (seq_mean)."""
    from megatron_pg_agg.core.losses import KL_ESTIMATORS

    out = {}
    for i, (mode, policy) in enumerate((m, p) for m in MODES for p in ("gspo", "gmpo", "cispo")):
        estimator = KL_ESTIMATORS[i % len(KL_ESTIMATORS)]
        out[f"{mode}-{policy}-{estimator}"] = (
            ["--pg-loss-aggregation", mode, *MODES[mode], "--pg-policy-loss", policy, "--pg-kl-estimator", estimator],
            _numbers(mode, policy, estimator))
    for estimator in ("k1", "k2"):
        out[f"token_mean-ppo-{estimator}"] = (["--pg-kl-estimator", estimator],
                                              _numbers("token_mean", "ppo", estimator))
    for kind, (cap, floor) in CORRECTIONS.items():
        out[f"seq_mean-ppo-{kind}"] = (
            ["--pg-loss-aggregation", "seq_mean", "--pg-rollout-correction", kind,
             "--pg-rollout-correction-max", str(cap), "--pg-rollout-correction-min", str(floor)],
            _numbers("seq_mean", correction=(kind, cap, floor)))
    return out


CORRECTIONS = {"token_truncate": (1.02, 0.0), "token_mask": (1.02, 0.97), "sequence_truncate": (1.01, 0.0),
               "sequence_mask": (1.01, 0.99)}


def test_every_policy_loss_estimator_and_correction_records_the_reference(checkout, work, initial_checkpoint,
                                                                         reference_tokens):
    """DP=2 (2 microbatches per rank), iteration 1 from the common initial weights: every mode x
    gspo/gmpo/cispo, ppo with each KL estimator, and ppo with each rollout correction (rollouts
    with the engine's log-probs, --pg-rollouts): every recorded number, the correction counts
    included, equals the float64 reference. Catches a policy-loss, estimator or correction flag
    that does not reach the loss, a sequence ratio from a per-rank N_i, and a count over the
    wrong mask."""
    from megatron_pg_agg.data.rollout_files import write_rollouts
    from megatron_pg_agg.data.synthetic import synthetic_rollouts
    from tests.support.rollouts import with_engine_logprobs

    steps = with_engine_logprobs(synthetic_rollouts(vocab_size=127, seed=1234))
    rollout_file = write_rollouts(work / "engine_steps.jsonl", steps)
    variants = _policy_variants()
    runs = [{"name": name, "argv": [
        "--megatron-lm", str(checkout), *TINY, *LOSS, *LAYOUT_OPTIMIZER, "--train-iters", "1",
        "--load", str(initial_checkpoint), "--finetune", "--pg-rollouts", str(rollout_file), *flags,
        "--pg-metrics-file", str(work / f"policy_{name}.jsonl")]} for name, (flags, _) in variants.items()]
    status, out = _batch(work, "policies", 2, runs)
    assert status == {name: 0 for name in variants}, out[-20000:]
    worst = {}
    for name, (_, numbers) in variants.items():
        (record,) = _records(work / f"policy_{name}.jsonl")
        want = reference_record(steps[0], reference_tokens, numbers)
        assert record["iteration"] == 1 and record["rollout_step"] == 0 and record["skipped"] is False, name
        for key, err in _assert_record_is_the_reference(record, want, name).items():
            worst[key] = max(worst.get(key, 0.0), err)
        if numbers.correction:  # the correction acts on this data
            assert record["correction_masked" if numbers.correction[0].endswith("mask") else "correction_truncated"] > 0
    print("worst relative error per field over", len(variants), "runs:", {k: f"{v:.1e}" for k, v in worst.items()})


def test_refusals_exit_2_before_training_naming_the_fix(checkout, work):
    """Each refusal exits 2 before the first step with a message naming the fix; the same base
    flags then train, dense and with experts, RoPE, SwiGLU, RMSNorm and GQA."""
    base = ["--megatron-lm", str(checkout), *TINY, "--train-iters", "2"]
    # the real script, as a user runs it: the documented exit status comes from the process
    rc, out, _ = run(launch_command(1, SCRIPT, *base, "--pg-loss-aggregation", "prompt_mean"), LAUNCH_S,
                     "refusal: no --calculate-per-token-loss")
    assert rc == 2, out[-5000:]
    assert "--calculate-per-token-loss is missing" in out and "Add --calculate-per-token-loss" in out, out[-5000:]
    assert "[pg] iteration" not in out and "building GPT model" not in out  # refused before the model

    bad_tokens = work / "bad_tokens.jsonl"
    from megatron_pg_agg.data.rollout_files import write_rollouts
    from megatron_pg_agg.data.synthetic import synthetic_rollouts

    steps = synthetic_rollouts(vocab_size=127, seed=1234)
    steps[2][5].response_ids[1] = 130  # valid for no vocabulary the loader knows; the padded one is 128
    write_rollouts(bad_tokens, steps)
    runs = [
        {"name": "bad mode", "argv": [*base, *LOSS, "--pg-loss-aggregation", "token-median"]},
        {"name": "constant without divisor", "argv": [*base, *LOSS, "--pg-loss-aggregation", "constant"]},
        {"name": "dataloader", "argv": [*base, *LOSS, "--dataloader-type", "single"]},
        {"name": "token beyond the padded vocabulary",
         "argv": [*base, *LOSS, "--pg-rollouts", str(bad_tokens)]},
        {"name": "correction without rollout_logprobs",
         "argv": [*base, *LOSS, "--pg-rollout-correction", "token_truncate"]},
        {"name": "mtp with learned positions", "argv": [*base, *LOSS, "--mtp-num-layers", "1"]},
        # megatron-core's known silent bug: attention sinks' grad norm under TP (Megatron-LM #7452,
        # finding 8), refused from the raw flags, before Megatron-LM checks TP 2 against one process
        {"name": "learnable sinks under TP",
         "argv": [*base, *LOSS, "--softmax-type", "learnable", "--tensor-model-parallel-size", "2"]},
        {"name": "ok", "argv": [*base, *LOSS, "--train-iters", "1"]},
        {"name": "gspo", "argv": [*base, *LOSS, "--train-iters", "1", "--pg-policy-loss", "gspo",
                                  "--pg-loss-aggregation", "seq_mean"]},
        # Megatron-LM's model flags through its own gpt_builder, experts included: the entry point
        # must apply the MoE aux-loss patch (else check_megatron_config refuses, exit 2) and set
        # the step factor before the first forward (else the patched router raises)
        {"name": "moe", "argv": [*base, *LOSS, "--train-iters", "1", "--num-experts", "4",
                                 "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
                                 "--disable-bias-linear", "--position-embedding-type", "rope",
                                 "--swiglu", "--no-bias-swiglu-fusion", "--normalization", "RMSNorm",
                                 "--group-query-attention", "--num-query-groups", "2"]},
    ]
    status, out = _batch(work, "refusals", 1, runs)
    parts = split_by_run(out)
    assert status == {"bad mode": 2, "constant without divisor": 2, "dataloader": 2,
                      "token beyond the padded vocabulary": 2, "correction without rollout_logprobs": 2,
                      "mtp with learned positions": 2, "learnable sinks under TP": 2, "ok": 0, "gspo": 0,
                      "moe": 0}, out[-20000:]
    assert "--pg-loss-aggregation" in parts["bad mode"] and "token-median" in parts["bad mode"]
    assert "--pg-loss-aggregation-divisor" in parts["constant without divisor"]
    assert "--dataloader-type single" in parts["dataloader"] and "external" in parts["dataloader"]
    vocab = parts["token beyond the padded vocabulary"]
    assert "rollout step 2" in vocab and "response_ids[1]=130" in vocab and "[0, 128)" in vocab, vocab[-5000:]
    assert "rollout_logprobs is missing" in parts["correction without rollout_logprobs"]
    mtp = parts["mtp with learned positions"]
    assert "--position-embedding-type learned_absolute (Megatron-LM's default)" in mtp and "AssertionError" not in mtp
    sinks = parts["learnable sinks under TP"]
    assert "--softmax-type learnable with --tensor-model-parallel-size 2" in sinks and "#7452" in sinks, sinks[-5000:]
    for name in ("bad mode", "constant without divisor", "dataloader", "token beyond the padded vocabulary",
                 "correction without rollout_logprobs", "mtp with learned positions", "learnable sinks under TP"):
        assert "[pg] iteration" not in parts[name] and "iteration        1/" not in parts[name], name
    assert "[pg] iteration 1/1" in parts["ok"]  # the same flags train once the problem is gone
    assert "[pg] iteration 1/1" in parts["gspo"] and "mode=seq_mean" in parts["gspo"]
    assert "[pg] iteration 1/1" in parts["moe"] and "load_balancing_loss" in parts["moe"], parts["moe"][-5000:]


def test_kill_after_a_save_and_resume_equals_the_uninterrupted_run(checkout, work, initial_checkpoint):
    """SIGKILL the whole launch once Megatron-LM's first checkpoint is complete, resume with its
    own --load (default torch_dist format): the later iterations' objective and grad norm equal
    an uninterrupted run's, and the data position is the resumed iteration's rollout step."""
    ckpt, killed_metrics = work / "resume_ckpt", work / "killed.jsonl"
    common = ["--megatron-lm", str(checkout), *TINY, *LOSS, "--pg-loss-aggregation", "prompt_mean"]
    proc = start(launch_command(2, SCRIPT, *common, "--load", initial_checkpoint, "--finetune",
                          "--train-iters", 1000, "--save", ckpt, "--save-interval", 3,
                          "--pg-metrics-file", killed_metrics))
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + LAUNCH_S
    while not tracker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_launch(proc)
    rc, out = finish(proc, 60, "killed run")
    assert tracker.exists(), out[-20000:]
    saved = int(tracker.read_text())
    assert saved % 3 == 0 and saved >= 3
    # resumed with the killed run's own flags (its LR schedule is checkpointed against
    # --train-iters), stopped by Megatron-LM's --exit-interval two iterations later
    stop = ["--train-iters", "1000", "--exit-interval", str(saved + 2)]
    runs = [
        {"name": "resumed", "argv": [*common, "--load", str(ckpt), *stop,
                                     "--pg-metrics-file", str(work / "resumed.jsonl")]},
        {"name": "uninterrupted", "argv": [*common, "--load", str(initial_checkpoint), "--finetune", *stop,
                                           "--pg-metrics-file", str(work / "uninterrupted.jsonl")]},
    ]
    status, out = _batch(work, "resume", 2, runs)
    assert status == {"resumed": 0, "uninterrupted": 0}, out[-20000:]
    resumed, whole = _records(work / "resumed.jsonl"), _records(work / "uninterrupted.jsonl")
    assert [r["iteration"] for r in resumed] == [saved + 1, saved + 2]
    assert resumed[0]["rollout_step"] == saved % 4  # 3 mod 4: not where a restart from 0 would be
    for ours in resumed:
        ref = whole[ours["iteration"] - 1]
        assert ref["iteration"] == ours["iteration"]
        assert ours["objective"] == ref["objective"] and ours["grad_norm"] == ref["grad_norm"], (ours, ref)


def _fake_checkout(tmp: Path, real: Path, minor: int) -> Path:
    """A checkout whose megatron/core/package_info.py names 0.<minor>.0 and whose training side is
    the real one (a link): what a user's git checkout of another tag looks like to the entry."""
    root = tmp / f"Megatron-LM-0.{minor}"
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 0\n")
    for part in (real / "megatron").iterdir():
        (root / "megatron" / part.name).symlink_to(part)
    for name in ("gpt_builders.py", "model_provider.py"):
        (root / name).symlink_to(real / name)
    return root


def test_mismatched_and_untested_checkouts_exit_2_naming_the_versions(checkout, work):
    """The real script, as a user runs it: a checkout of another minor release than the installed
    megatron-core, and one newer than the tested range (refused; with the override it warns and
    is then refused as a mismatch), each exit 2 before any model, naming both versions or the range.
    Catches a release check that reads only pretrain()'s signature (the same 0.15 to 0.17)."""
    from megatron_pg_agg import versions

    installed = versions.installed_megatron_core_version()
    minor = int(installed.split(".")[1])
    other = _fake_checkout(work, checkout, 17 if minor != 17 else 16)
    newer = _fake_checkout(work, checkout, 20)
    base = [*TINY, *LOSS, "--train-iters", "1"]
    rc, out, _ = run(launch_command(1, SCRIPT, "--megatron-lm", other, *base), LAUNCH_S, "mismatched checkout")
    assert rc == 2, out[-5000:]
    assert f"core_v0.{17 if minor != 17 else 16}.0" in out and f"megatron-core {installed}" in out, out[-5000:]
    rc, out, _ = run(launch_command(1, SCRIPT, "--megatron-lm", newer, *base), LAUNCH_S, "newer checkout")
    assert rc == 2 and "core_v0.20.0" in out and versions.SUPPORTED_MEGATRON_CORE in out, out[-5000:]
    assert versions.ALLOW_UNTESTED_ENV in out and "[pg] iteration" not in out
    from tests.support.launching import child_env

    env = child_env(**{versions.ALLOW_UNTESTED_ENV: "1"})
    env.pop("PYTHONWARNINGS")  # the override's warning shows, as for a user
    rc, out, _ = run(launch_command(1, SCRIPT, "--megatron-lm", newer, *base), LAUNCH_S, "newer checkout, override",
                     env=env)
    assert rc == 2 and "newer than the tested range" in out and f"megatron-core {installed}" in out, out[-5000:]
