"""The actor inside Megatron-LM's own RL loop: launch/train_rl_actor.py on a real core_v0.19 checkout.

Rollouts are replayed at Megatron-LM's rollout seam (``--pg-replay-rollouts``, written by
tests/support/rl_replay_data.py); everything after them is Megatron-LM's RL loop: its group
advantages, its old and reference log-prob passes, ``--grpo-iterations`` passes, its optimizer
and schedule. 4 groups x 2 rollouts per collection, 4 sequences (2 whole groups) per optimizer
step, 2 passes: 4 iterations, all from the first collection. The RL entry targets megatron-core
0.19 with Megatron-LM core_v0.19.x; on other releases these tests skip with that reason, except
the refusal, which runs everywhere. On the 0.19 leg of .ci/run they never skip.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_pg_agg.versions import in_range, installed_megatron_core_version
from tests.support.launching import ROOT, launch_command, run, split_by_run, worker
from tests.support.reference import LossNumbers, reference_record
from tests.support.rl_replay_data import PAD, ReplayedRollout, grpo_advantages, split, write_replay

SCRIPT = ROOT / "launch" / "train_rl_actor.py"
PRETRAIN = ROOT / "launch" / "pretrain_actor.py"
RUNS = worker("megatron_lm_runs")
REFERENCE = worker("megatron_rl_reference")
RL_RELEASE = in_range(installed_megatron_core_version(), ">=0.19,<0.20")
LAUNCH_S = 400

MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    # the pretrain entry's built-in rollouts (the initial checkpoint) need 256 positions
    "--seq-length", "64", "--max-position-embeddings", "256", "--micro-batch-size", "1",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--make-vocab-size-divisible-by", "64",
    "--null-tokenizer-pad-id", str(PAD),
    "--distributed-backend", "gloo", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion",
    "--use-cpu-initialization", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--seed", "1234",
]
GROUPS, GROUP_SIZE, BATCH, PASSES = 4, 2, 4, 2
ITERS = PASSES * GROUPS * GROUP_SIZE // BATCH
# SGD, as the pretrain entry's layout tests (Adam's first step amplifies float noise near g = 0)
OPTIMIZER = ["--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.05", "--lr-decay-style", "constant"]
RL = ["--calculate-per-token-loss", "--global-batch-size", str(BATCH), "--grpo-prompts-per-step", str(GROUPS),
      "--grpo-group-size", str(GROUP_SIZE), "--grpo-iterations", str(PASSES), "--train-iters", str(ITERS)]
# Megatron-LM's RL loss defaults, which the entry translates: clamp 0.01 / 0.01, KL beta 0.001 (k3)
EPS, KL_BETA, DIVISOR = 0.01, 0.001, 32.0
MODES = {"token_mean": [], "seq_mean": [], "prompt_mean": [],
         "constant": ["--pg-loss-aggregation-divisor", str(DIVISOR)]}
POLICY_LOSSES = ("ppo", "gspo", "gmpo", "cispo")
PRODUCTION = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
              "--ddp-bucket-size", "4000"]
# megatron-core's distributed optimizer takes Adam only: its runs, and their plain-DDP twins, use it
ADAM = ["--optimizer", "adam", "--lr", "1e-3", "--min-lr", "1e-3"]
LAYOUTS = {  # packed THD microbatches (the default) on every layout; DP1 also one sequence per microbatch
    "DP1": (1, []),
    "DP2": (2, []),
    "TP2": (2, ["--tensor-model-parallel-size", "2"]),
    "PP2": (2, ["--pipeline-model-parallel-size", "2"]),
}


def _records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rel(a: float, b: float, floor: float = 1e-30) -> float:
    return abs(a - b) / max(abs(b), floor)


TERM_SIZE = 0.5
"""The size of the per-token terms an objective averages: -A r with GRPO advantages normalised to
unit std per group (|A| ~ 1), which cancel to objectives of ~1e-2 (~1e-8 for seq_mean at ratio 1).
Float32 rounding of such an average is ~1e-7 absolute, so an objective's error is taken against
max(|J|, TERM_SIZE); a factor 1.001 on the smallest objective here (0.01) is still 20 times over 1e-6."""


def _objective_err(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), TERM_SIZE)


@pytest.fixture(scope="module")
def checkout(megatron_lm_checkout) -> Path:
    if not RL_RELEASE:
        pytest.skip(f"the RL entry targets megatron-core 0.19 with Megatron-LM core_v0.19.x; installed "
                    f"megatron-core {installed_megatron_core_version()} (the refusal is tested on this release)")
    return megatron_lm_checkout


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("megatron_rl")


@pytest.fixture(scope="module")
def replay(work) -> tuple:
    path = work / "replay.jsonl"
    return path, write_replay(path, groups=GROUPS, group_size=GROUP_SIZE)


@pytest.fixture(scope="module")
def initial_checkpoint(checkout, work) -> Path:
    """One iteration of the pretrain entry (1 process, its built-in rollouts) saved with
    Megatron-LM's ``--save``: the common initial weights of every RL run (PP seeds per stage)."""
    ckpt = work / "init"
    rc, out, _ = run(launch_command(1, PRETRAIN, "--megatron-lm", checkout, *MODEL, *OPTIMIZER,
                                    "--global-batch-size", 4,
                              "--calculate-per-token-loss", "--seq-length", 256,
                              "--train-iters", 1, "--save", ckpt, "--save-interval", 1), LAUNCH_S, "initial checkpoint")
    assert rc == 0, out[-20000:]
    return ckpt


def _rl_argv(checkout, ckpt, replay_path, metrics: Path, *flags) -> list:
    return ["--megatron-lm", str(checkout), *MODEL, *OPTIMIZER, *RL, "--load", str(ckpt), "--finetune",
            "--pg-replay-rollouts", str(replay_path), "--pg-metrics-file", str(metrics), *map(str, flags)]


def _batch(work: Path, name: str, nproc: int, runs: list) -> tuple:
    spec, result = work / f"{name}.runs.json", work / f"{name}.result.json"
    spec.write_text(json.dumps([{**r, "entry": "rl"} for r in runs]))
    rc, out, _ = run(launch_command(nproc, RUNS, spec, result), LAUNCH_S, f"RL runs {name}")
    assert rc == 0 and result.exists(), out[-20000:]
    return json.loads(result.read_text()), out


LR_SCHEDULE = ["--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--lr-decay-iters", "7",
               "--min-lr", "0.005", "--train-iters", str(2 * ITERS), "--seq-length", "128"]
"""A warm-up and a cosine decay over two collections: Megatron-LM's schedule steps by the samples
``train()`` counts, so a wrong count shows as another learning rate (Megatron-LM #3078). At
``--seq-length 128`` two of these sequences fit one microbatch, for Megatron-LM's packer too."""
IS_CORRECTION = ["--rl-inference-logprobs-is-correction", "--rl-importance-sampling-truncation-coef", "1.2"]
WHOLE = ["--global-batch-size", str(GROUPS * GROUP_SIZE), "--train-iters", str(PASSES)]
"""One optimizer step per collection: Megatron-LM's own loop then composes the same step on every
layout (with several steps per collection its step ``k`` is rows ``k*b .. (k+1)*b - 1`` of each DP
rank's contiguous slice, so which groups share a step depends on the DP size)."""


@pytest.fixture(scope="module")
def layout_runs(checkout, work, replay, initial_checkpoint) -> dict:
    """``{layout: {key: [records]}}``: every (mode, policy loss) on every layout from the common
    initial weights; on DP1 and DP2 also Megatron-LM's own loss ("megatron"), and both losses with
    one step per collection ("ours-whole", "megatron-whole")."""
    out = {}
    for layout, (nproc, flags) in LAYOUTS.items():
        runs = {}
        for mode, extra in MODES.items():
            for policy in POLICY_LOSSES:
                runs[(mode, policy)] = ["--pg-loss-aggregation", mode, *extra, "--pg-policy-loss", policy]
        if layout in ("DP1", "DP2"):
            runs["megatron"] = ["--pg-loss-source", "megatron"]
            runs["megatron-whole"] = ["--pg-loss-source", "megatron", *WHOLE]
            runs["ours-whole"] = WHOLE
        if layout == "DP1":  # Megatron-LM's IS correction, translated, against its own
            runs["megatron-is"] = ["--pg-loss-source", "megatron", *IS_CORRECTION]
            runs["ours-is"] = IS_CORRECTION
            for mode, extra in MODES.items():  # one sequence per microbatch: Megatron-LM's unpacked shape
                runs[("unpacked", mode)] = ["--no-pg-sequence-packing", "--pg-loss-aggregation", mode, *extra]
            runs["rl-packing-flag"] = ["--rl-use-sequence-packing"]
            runs["no-plan-ahead"] = ["--no-pg-plan-ahead"]
        if layout == "DP2":  # Megatron-LM's production flags, every mode (test_the_production_flags_...)
            for mode, extra in MODES.items():
                # two collections: the second's log-prob passes read the weights one update left
                two = ["--train-iters", str(2 * ITERS)]
                runs[("production", mode)] = ["--pg-loss-aggregation", mode, *extra, *ADAM, *two, *PRODUCTION]
                runs[("production-twin", mode)] = ["--pg-loss-aggregation", mode, *extra, *ADAM, *two]
            runs["ours-tensorboard"] = ["--pg-loss-aggregation", "prompt_mean", "--tensorboard-dir",
                                        str(work / "tensorboard")]
            runs["lr-ours"] = LR_SCHEDULE
            runs["lr-ours-unpacked"] = ["--no-pg-sequence-packing", *LR_SCHEDULE]
            runs["lr-megatron"] = ["--pg-loss-source", "megatron", *LR_SCHEDULE]
            runs["lr-megatron-packed"] = ["--pg-loss-source", "megatron", "--rl-use-sequence-packing", *LR_SCHEDULE]
        names = {key: "-".join(key) if isinstance(key, tuple) else key for key in runs}
        specs = [{"name": names[key], "argv": _rl_argv(checkout, initial_checkpoint, replay[0],
                                                       work / f"{layout}-{names[key]}.jsonl", *flags, *extra)}
                 for key, extra in runs.items()]
        status, _ = _batch(work, layout, nproc, specs)
        assert status == {spec["name"]: 0 for spec in specs}, status
        out[layout] = {key: _records(work / f"{layout}-{names[key]}.jsonl") for key in runs}
    return out


def test_every_layout_gives_the_same_objective_and_grad_norm_in_every_mode_and_policy_loss(layout_runs):
    """DP=2, TP=2 and PP=2 against one rank with 4 microbatches, every iteration (both passes over
    the collection: the second pass has ratios away from 1 and clipping)."""
    worst = {}
    base = layout_runs["DP1"]
    for layout in ("DP2", "TP2", "PP2"):
        for key, records in layout_runs[layout].items():
            if not isinstance(key, tuple) or key[0] in ("unpacked", "production", "production-twin"):
                continue
            want = base[key]
            assert [r["iteration"] for r in records] == list(range(1, ITERS + 1)), (layout, key)
            for got, ref in zip(records, want):
                err = (_objective_err(got["objective"], ref["objective"]), _rel(got["grad_norm"], ref["grad_norm"]))
                worst[layout] = tuple(map(max, worst.get(layout, (0.0, 0.0)), err))
                assert err[0] < 1e-6 and err[1] < 1e-6, (layout, key, got, ref)
                assert (got["weight"], got["valid_tokens"]) == (ref["weight"], ref["valid_tokens"]), (layout, key)
    print("worst (objective, grad norm) relative error per layout:", worst)


def test_the_production_flags_keep_every_mode_exact(layout_runs):
    """DP=2 with Megatron-LM's --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    (small buckets, Adam: the only optimizer it takes), two collections, every iteration and mode, against the same
    run with plain DDP, and its first iteration against one rank: the reduce-scattered, overlapped
    gradients and the all-gathered parameters change no number. Catches a bucket reduced before its
    last microbatch (the microbatch count varies), and a second collection or step on stale shards."""
    worst = (0.0, 0.0)
    for mode in MODES:
        twin, one_rank = layout_runs["DP2"][("production-twin", mode)], layout_runs["DP1"][(mode, "ppo")]
        got_all, want_all = layout_runs["DP2"][("production", mode)], one_rank[:1] + twin[1:]
        assert [r["iteration"] for r in got_all] == list(range(1, 2 * ITERS + 1)), mode
        for got, ref in zip(got_all, want_all):
            err = (_objective_err(got["objective"], ref["objective"]), _rel(got["grad_norm"], ref["grad_norm"]))
            worst = tuple(map(max, worst, err))
            assert err[0] < 1e-6 and err[1] < 1e-6, (mode, got, ref)
            assert (got["weight"], got["valid_tokens"]) == (ref["weight"], ref["valid_tokens"]), mode
    print("production flags, worst (objective, grad norm) relative error:", worst)


def test_packed_steps_equal_one_sequence_per_microbatch(layout_runs):
    """The packed THD microbatches (several whole sequences each, fewer microbatches) give the
    objective, grad norm and weights of one sequence per microbatch at every iteration, in every mode."""
    dp1 = layout_runs["DP1"]
    for mode in MODES:
        packed, unpacked = dp1[(mode, "ppo")], dp1[("unpacked", mode)]
        assert len(packed) == len(unpacked) == ITERS, mode
        for got, ref in zip(packed, unpacked):
            assert _objective_err(got["objective"], ref["objective"]) < 1e-6, (mode, got, ref)
            assert _rel(got["grad_norm"], ref["grad_norm"]) < 1e-6, (mode, got, ref)
            assert (got["weight"], got["valid_tokens"]) == (ref["weight"], ref["valid_tokens"]), mode
            assert ref["microbatches"] == BATCH and got["microbatches"] < BATCH, (mode, got, ref)


def test_megatron_lms_packing_flag_is_the_planners_packing(layout_runs):
    """``--rl-use-sequence-packing`` is taken as the planner's packing (whole groups per step, the
    unpacked run's sample counts), not Megatron-LM's packer: the records equal the default run's."""
    assert layout_runs["DP1"]["rl-packing-flag"] == layout_runs["DP1"][("token_mean", "ppo")]


def test_planning_the_next_step_in_the_background_changes_no_number(layout_runs):
    """Step k + 1 planned on a host thread while step k runs (the default) against every step
    planned when it starts (``--no-pg-plan-ahead``): the same records, to the bit."""
    assert layout_runs["DP1"]["no-plan-ahead"] == layout_runs["DP1"][("token_mean", "ppo")]


def test_the_learning_rate_of_every_iteration_is_the_unpacked_runs(layout_runs):
    """Megatron-LM #3078: its own packing hands the schedule the bin count, so its learning rate
    (warm-up and cosine decay, which step by counted samples) advances by bins. The packed entry
    keeps Megatron-LM's sample count: at every iteration its learning rate equals that of the same
    run with one sequence per microbatch and that of Megatron-LM's own unpacked path."""
    dp2 = layout_runs["DP2"]
    ours, unpacked, theirs = (dp2[k] for k in ("lr-ours", "lr-ours-unpacked", "lr-megatron"))
    assert len(ours) == len(unpacked) == len(theirs) == 2 * ITERS
    lrs = [[r["learning_rate"] for r in records] for records in (ours, unpacked, theirs)]
    assert lrs[0] == lrs[1] == lrs[2], lrs
    assert len(set(lrs[0])) > ITERS  # the schedule moves at (nearly) every iteration here
    assert any(r["microbatches"] < BATCH // 2 for r in ours)  # packed: fewer microbatches than sequences
    # control: Megatron-LM's own packed path gives other rates on the same run (the trap is real here)
    packed = [r["learning_rate"] for r in dp2["lr-megatron-packed"]]
    assert len(packed) == 2 * ITERS and packed != lrs[0], (packed, lrs[0])


def test_the_modes_differ_on_this_data(layout_runs):
    """Control for the agreement above: the modes give different first-step objectives here."""
    first = {mode: layout_runs["DP1"][(mode, "ppo")][0]["objective"] for mode in MODES}
    values = sorted(first.values())
    assert min(b - a for a, b in zip(values, values[1:])) > 1e-4, first


@pytest.fixture(scope="module")
def reference_tokens(checkout, work, replay, initial_checkpoint) -> list:
    out = work / "reference.json"
    rc, log, _ = run(launch_command(1, REFERENCE, checkout, replay[0], out, "--", *MODEL, *OPTIMIZER,
                              "--global-batch-size", BATCH, "--train-iters", 1, "--load", initial_checkpoint,
                              "--finetune"), LAUNCH_S, "reference")
    assert rc == 0, log[-20000:]
    return json.loads(out.read_text())["tokens"]


def _first_step_rollouts(records: list, tokens: list) -> list:
    """Step 1 (the first BATCH rollouts): its rollouts with GRPO advantages and, as at the first
    step of a collection, old = reference = the initial policy's log-probs."""
    advantages = grpo_advantages(records, GROUP_SIZE)
    rollouts = []
    for i, record in enumerate(records[:BATCH]):
        prompt, response = split(record)
        logp = tokens[i][0]
        rollouts.append(ReplayedRollout(prompt, response, [int(t != PAD) for t in response],
                                        [advantages[i]] * len(response), logp, logp, record["group"]))
    return rollouts


def test_first_step_equals_the_independent_float64_reference(layout_runs, replay, reference_tokens):
    """Iteration 1 of every mode x policy loss on every layout: every recorded number against a
    float64 reference from the replayed rollouts and the initial weights alone."""
    rollouts = _first_step_rollouts(replay[1], reference_tokens)
    current = [(r.old_logprobs, reference_tokens[i][1]) for i, r in enumerate(rollouts)]
    worst = 0.0
    for layout, runs in layout_runs.items():
        for key, records in runs.items():
            if not isinstance(key, tuple):
                continue
            mode, policy = (key[1], "ppo") if key[0] in ("unpacked", "production", "production-twin") else key
            want = reference_record(rollouts, current, LossNumbers(
                mode=mode, policy=policy, eps_low=EPS, eps_high=EPS, divisor=DIVISOR if mode == "constant" else None,
                kl_coef=KL_BETA))
            got = records[0]
            assert (got["weight"], got["valid_tokens"]) == (want["weight"], want["valid_tokens"]), (layout, key)
            for name in ("objective", "pg_loss"):
                err = _objective_err(got[name], want[name])
                worst = max(worst, err)
                assert err < 1e-6, (layout, key, name, got[name], want[name])
            for name in ("ratio", "entropy"):
                assert _rel(got[name], want[name]) < 1e-5, (layout, key, name, got[name], want[name])
            assert got["clip_fraction"] == want["clip_fraction"] == 0.0
            assert abs(got["kl"]) < 1e-6 and want["kl"] == 0.0
    print(f"worst first-step objective / pg_loss error against the reference: {worst:.2e}")


def _same_as_megatron(ours: list, theirs: list, where) -> None:
    assert len(ours) == len(theirs) and ours, where
    for a, b in zip(ours, theirs):
        assert _objective_err(a["objective"], b["lm loss"]) < 1e-6, (where, a, b)
        assert _rel(a["grad_norm"], b["grad_norm"]) < 1e-6, (where, a, b)
        assert _rel(a["ratio"], b["rl/pi_over_pi_old"]) < 1e-6, (where, a, b)
        # k3 = exp(d) - d - 1 in float32 cancels to ~d^2 / 2: ~1e-8 absolute per token either way
        assert abs(a["kl"] - b["rl/kl_term"]) < 1e-7, (where, a, b)


def test_token_mean_ppo_equals_megatron_lms_own_loss_on_the_same_rollouts(layout_runs):
    """The peer cross-check: token_mean + ppo with Megatron-LM's loss defaults (clamp 0.01, KL beta
    0.001 with k3, entropy weight 0) gives Megatron-LM's own ``lm loss``, grad norm, ratio and KL
    at every iteration wherever both compose the same steps: on one rank (2 steps x 2 passes), and
    with one step per collection on one rank and on DP=2. No sequence here lacks a valid token, so
    Megatron-LM's count of 1 per empty microbatch does not arise."""
    _same_as_megatron(layout_runs["DP1"][("token_mean", "ppo")], layout_runs["DP1"]["megatron"], "DP1")
    for layout in ("DP1", "DP2"):
        _same_as_megatron(layout_runs[layout]["ours-whole"], layout_runs[layout]["megatron-whole"], layout)


def test_megatron_lms_is_correction_translated_equals_its_own(layout_runs):
    """``--rl-inference-logprobs-is-correction --rl-importance-sampling-truncation-coef 1.2`` become
    the project's token_truncate correction with cap 1.2: the same objective and gradients as
    Megatron-LM's own truncated IS weights on the replayed inference log-probs."""
    ours, theirs = layout_runs["DP1"]["ours-is"], layout_runs["DP1"]["megatron-is"]
    _same_as_megatron(ours, theirs, "IS correction")
    plain = layout_runs["DP1"][("token_mean", "ppo")]
    assert _objective_err(ours[0]["objective"], plain[0]["objective"]) > 1e-3  # the correction acts here
    assert 0 < ours[0]["correction_truncated"] < 1  # the cap acts on some tokens


def test_tensorboard_gets_the_step_values_through_megatron_lms_writer(work, layout_runs):
    """With --tensorboard-dir, Megatron-LM's own writer holds the ``pg/*`` scalars of every iteration."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(work / "tensorboard"))
    events.Reload()
    records = layout_runs["DP2"]["ours-tensorboard"]
    for key in ("objective", "weight", "clip_fraction", "kl", "entropy"):
        scalars = {e.step: e.value for e in events.Scalars(f"pg/{key}")}
        assert sorted(scalars) == [r["iteration"] for r in records], key
        for r in records:
            assert scalars[r["iteration"]] == pytest.approx(r[key], rel=1e-6), (key, r["iteration"])
    assert records == layout_runs["DP2"][("prompt_mean", "ppo")]  # the writer changes no number


def test_megatron_lms_own_steps_depend_on_the_dp_size_and_ours_do_not(layout_runs):
    """With 2 steps per collection Megatron-LM's DP=2 trains groups 0 and 2 in its first step (each
    rank's first rows of its contiguous slice), its DP=1 groups 0 and 1: another objective from the
    same rollouts and weights. The project's steps are whole groups in collection order on every
    layout (the DP1 and DP2 records agree, test above)."""
    dp1, dp2 = layout_runs["DP1"]["megatron"][0], layout_runs["DP2"]["megatron"][0]
    assert _objective_err(dp2["lm loss"], dp1["lm loss"]) > 1e-3, (dp1, dp2)
    ours = layout_runs["DP2"][("token_mean", "ppo")][0]
    assert _objective_err(ours["objective"], dp1["lm loss"]) < 1e-6, (ours, dp1)


def test_megatron_lms_loss_differs_from_ours_where_the_modes_differ(layout_runs):
    """Control: Megatron-LM's own loss is a token mean; on this ragged data seq_mean and
    prompt_mean give other objectives and gradients already at the first step."""
    theirs = layout_runs["DP1"]["megatron"][0]
    for mode in ("seq_mean", "prompt_mean"):
        ours = layout_runs["DP1"][(mode, "ppo")][0]
        assert _objective_err(ours["objective"], theirs["lm loss"]) > 1e-3, (mode, ours, theirs)
        assert _rel(ours["grad_norm"], theirs["grad_norm"]) > 1e-3, (mode, ours, theirs)


# ----------------------------------------------------------------------------- packed log-prob passes (issue 40)

PACKED_LOGPROB_LAYOUTS = {  # name -> (launch, flags); the 2-rank layouts share one launch
    "DP1": (1, []),
    "DP2": (2, []),
    "TP2": (2, ["--tensor-model-parallel-size", "2"]),
    "PP2": (2, ["--pipeline-model-parallel-size", "2"]),
}
NO_KL = ["--grpo-kl-beta", "0"]


@pytest.fixture(scope="module")
def logprob_runs(checkout, work, replay, initial_checkpoint) -> dict:
    """``{(layout, case, switch): (records, rows)}``: whole runs with the packed log-prob passes
    (``on``, the default) and with Megatron-LM's ``compute_logprobs_batch`` (``off``,
    ``--no-pg-packed-logprobs``); ``rows`` (the worker's ``logprob_rows`` record) where kept. One
    rank: every mode, without the KL term, with the IS correction; two ranks: DP=2, TP=2, PP=2,
    and on DP=2 the IS correction and prompt_mean."""
    cases = {"DP1": {mode: ["--pg-loss-aggregation", mode, *extra] for mode, extra in MODES.items()}}
    cases["DP1"].update({"no-kl": NO_KL, "is": IS_CORRECTION})
    for layout in ("DP2", "TP2", "PP2"):
        cases[layout] = {"token_mean": []}
    cases["DP2"].update({"is": IS_CORRECTION, "prompt_mean": ["--pg-loss-aggregation", "prompt_mean"]})
    out = {}
    for nproc in (1, 2):
        specs, names = [], {}
        for layout, (n, flags) in PACKED_LOGPROB_LAYOUTS.items():
            if n != nproc:
                continue
            for case, extra in cases[layout].items():
                for switch, switch_flags in (("on", []), ("off", ["--no-pg-packed-logprobs"])):
                    name = f"lp-{layout}-{case}-{switch}"
                    names[(layout, case, switch)] = name
                    specs.append({"name": name, "logprob_rows": str(work / f"{name}.pt"), "argv": _rl_argv(
                        checkout, initial_checkpoint, replay[0], work / f"{name}.jsonl", *flags, *extra,
                        *switch_flags)})
        status, _ = _batch(work, f"packed-logprobs-{nproc}", nproc, specs)
        assert status == {spec["name"]: 0 for spec in specs}, status
        import torch

        for key, name in names.items():
            out[key] = (_records(work / f"{name}.jsonl"), torch.load(work / f"{name}.pt", weights_only=False))
    return out


LOGPROB_TOL = 2e-6
"""Float32 log-probs of a 127-token vocabulary (about -4.8) from two attention shapes (packed THD
microbatches against rows of --seq-length): a few float32 roundings apart."""


def _scored(rows: dict):
    """bool ``[N, S-1]``: the entries Megatron-LM's loop reads (generated tokens' positions)."""
    return rows["generation_mask"][:, 1:]


def test_packed_logprob_passes_equal_megatron_lms_compute_logprobs_batch(logprob_runs):
    """Old and reference log-probs (and the aligned inference log-probs of the IS runs) from the
    packed forward-only passes against Megatron-LM's own unpacked ``compute_logprobs_batch``, at
    every entry its loop reads: on every layout against the same layout's unpacked run, and against
    one rank's. The switch really switches passes (the worker counts which pass was built)."""
    import torch

    worst = {}
    reference = logprob_runs[("DP1", "token_mean", "off")][1]
    for (layout, case, switch), (_, rows) in logprob_runs.items():
        if switch != "on":
            continue
        off = logprob_runs[(layout, case, "off")][1]
        assert (rows["packed"], rows["unpacked"], off["packed"], off["unpacked"]) == (1, 0, 0, 1), (layout, case)
        assert len(rows["collections"]) == len(off["collections"]) == 1
        got, want = rows["collections"][0], off["collections"][0]
        mask = _scored(want)
        assert torch.equal(got["generation_mask"], want["generation_mask"]) and bool(mask.any())
        pairs = [(got, want)] + ([(got, reference["collections"][0])] if case == "token_mean" else [])
        for a, b in pairs:
            for name in ("old", "ref") + (("rollout",) if case == "is" else ()):
                err = float((a[name][mask] - b[name][mask]).abs().max())
                worst[(layout, name)] = max(worst.get((layout, name), 0.0), err)
                assert err < LOGPROB_TOL, (layout, case, name, err)
        assert float(got["old"][mask].abs().min()) > 0.1  # real log-probs at every read entry (no zeros)
    print("worst |packed - unpacked| log-prob per layout:", worst)


def _same_records(ours: list, theirs: list, where) -> None:
    assert len(ours) == len(theirs) == ITERS, where
    for a, b in zip(ours, theirs):
        assert set(a) == set(b), where
        for key, value in a.items():
            other = b[key]
            if key in ("tokens_per_s", "elapsed_s", "run_id") or not isinstance(value, (int, float)):
                continue
            if isinstance(value, bool) or (isinstance(value, int) and isinstance(other, int)):
                assert value == other, (where, a["iteration"], key, value, other)
            elif key in ("objective", "pg_loss"):
                assert _objective_err(value, other) < 1e-6, (where, a["iteration"], key, value, other)
            else:
                assert abs(value - other) <= 1e-6 * max(abs(other), 1e-1), (where, a["iteration"], key, value, other)


def test_whole_runs_are_the_same_with_the_packed_logprob_passes_on_and_off(logprob_runs):
    """Every iteration record (both passes over the collection: ratios away from 1 from the second
    step on, clipping, the KL term against the reference) of every case and layout with the switch
    on and off: every mode, without the KL term, with the rollout correction."""
    for (layout, case, switch), (records, _) in logprob_runs.items():
        if switch == "on":
            _same_records(records, logprob_runs[(layout, case, "off")][0], (layout, case))


REFUSALS = {
    # name: (flags after the defaults, text the message must hold)
    "group straddles steps": (["--grpo-group-size", "4", "--global-batch-size", "6", "--grpo-prompts-per-step", "3"],
                              "--global-batch-size 6 is not a multiple of --grpo-group-size 4"),
    "collection not whole steps": (["--grpo-prompts-per-step", "3"], "not a multiple of --global-batch-size 4"),
    "packing on and off": (["--rl-use-sequence-packing", "--no-pg-sequence-packing"], "contradict each other"),
    "capacity below a trajectory": (["--pg-max-tokens-per-microbatch", "32"], "below --seq-length 64"),
    "megatron-lm's packer": (["--rl-sequence-packing-algo", "fifo"], "Megatron-LM's packer's setting"),
    "entropy term": (["--grpo-entropy-term-weight", "0.1"], "--pg-entropy-coef"),
    "truncation without correction": (["--rl-importance-sampling-truncation-coef", "2"],
                                      "without --rl-inference-logprobs-is-correction"),
    "two clip values": (["--grpo-clamp-eps-lower", "0.1", "--pg-clip-eps", "0.2"], "two values"),
    "two rollout sources": (["--langrl-env-config", "envs.yaml"], "both name the rollouts' source"),
}


def test_refusals_exit_2_before_training_naming_the_fix(checkout, work, replay, initial_checkpoint):
    base = _rl_argv(checkout, initial_checkpoint, replay[0], work / "refused.jsonl")
    runs = [{"name": name, "argv": base + flags} for name, (flags, _) in REFUSALS.items()]
    runs.append({"name": "per-token loss", "argv": [a for a in base if a != "--calculate-per-token-loss"]})
    at = base.index("--pg-replay-rollouts")
    runs.append({"name": "no rollouts", "argv": base[:at] + base[at + 2:]})
    status, out = _batch(work, "refusals", 1, runs)
    assert status == {r["name"]: 2 for r in runs}, status
    parts = split_by_run(out)
    texts = {**{name: text for name, (_, text) in REFUSALS.items()},
             "per-token loss": "--calculate-per-token-loss is missing", "no rollouts": "--langrl-env-config"}
    for name, text in texts.items():
        assert "refusing to start" in parts[name] and text in parts[name], (name, parts[name][-3000:])
        assert "iteration        1/" not in parts[name], name
    assert not (work / "refused.jsonl").exists()


def test_other_releases_are_refused_at_start_up(megatron_lm_checkout, third_party_checkouts, work):
    """On every release but 0.19 the entry refuses (exit 2) naming the release it needs; on 0.19 a
    core_v0.18 checkout is refused as not the installed release's."""
    checkout = megatron_lm_checkout if not RL_RELEASE else third_party_checkouts["Megatron-LM-core_v0.18.2"]
    rc, out, _ = run(launch_command(1, SCRIPT, "--megatron-lm", checkout, *MODEL, *RL,
                                    "--pg-replay-rollouts", "builtin"),
                     LAUNCH_S, "refused release")
    assert rc == 2, out[-5000:]
    assert "refusing to start" in out
    assert ("core_v0.19" in out) if not RL_RELEASE else ("0.18" in out and "0.19" in out), out[-5000:]
