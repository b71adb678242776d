"""The NeMo-RL plug-in's loss on NeMo-RL's own code, without Megatron: ``ClippedPGLossFn`` called the
way NeMo-RL's Megatron worker calls it, on batches cut by NeMo-RL's own ``BatchedDataDict``
(``shard_by_batch_size`` over DP with fixed micro-batches, dynamic batching and sequence packing,
``SequencePackingLossWrapper`` per sequence), on both of its paths (``train()``'s true step counts;
the split path's placeholders and one division at the end), in float64 against the formulas
(tests/support/nemo_rl_reference.py). Needs the NeMo-RL checkout (``MEGATRON_PG_AGG_NEMO_RL``) and
its Python stack (docs/nemo-rl.md); skips without them, fails under MEGATRON_PG_AGG_REQUIRE_NEMO_RL=1.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.support.nemo_rl_reference import DEFAULTS, Options, random_batch, reference_step
from tests.support.optional import require_nemo_rl

pytestmark = pytest.mark.optional_stack

MODES = {"token_mean": None, "seq_mean": None, "prompt_mean": None, "constant": 9.0}
SPLITS = ("fixed", "dynamic", "packing")
OPTIONS = [
    Options("ppo"),
    Options("dual_clip", dict(ratio_clip_c=1.05)),
    Options("clip_higher", dict(ratio_clip_min=0.01, ratio_clip_max=0.02)),
    Options("cispo", dict(use_cispo=True, ratio_clip_min=0.01, ratio_clip_max=0.02)),
    Options("gspo", dict(token_level_loss=False, sequence_level_importance_ratios=True, ratio_clip_min=0.01,
                         ratio_clip_max=0.02)),
    Options("reinforce", dict(disable_ppo_ratio=True)),
    Options("on_policy", dict(force_on_policy_ratio=True)),
    Options("kl_token_k3", dict(reference_policy_kl_penalty=0.05)),
    Options("kl_sequence_k1", dict(reference_policy_kl_penalty=0.05, reference_policy_kl_type="k1",
                                   token_level_loss=False)),
    Options("is_tis", dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                           truncated_importance_sampling_ratio=1.02)),
    Options("is_icepop", dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
                              truncated_importance_sampling_ratio=1.03, truncated_importance_sampling_ratio_min=0.98)),
    Options("is_seq_mask_tis", dict(use_importance_sampling_correction=True,
                                    truncated_importance_sampling_type="seq-mask-tis",
                                    truncated_importance_sampling_ratio=1.01,
                                    truncated_importance_sampling_ratio_min=0.99)),
    Options("is_gspo", dict(token_level_loss=False, sequence_level_importance_ratios=True,
                            use_importance_sampling_correction=True)),
    Options("vapo_nll", dict(positive_example_nll_weight=0.1)),
]
GROUP_SIZE, GROUPS, STEPS = 3, 8, 2
TOL = 1e-6  # float64 log-probs; the plug-in's scale field is float32 (6e-8 per token), masked_mean adds 1e-8


@pytest.fixture(scope="module")
def nemo():
    require_nemo_rl()
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig, ClippedPGLossFn
    from nemo_rl.algorithms.loss.wrapper import SequencePackingLossWrapper
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    return dict(config=ClippedPGLossConfig, loss=ClippedPGLossFn, wrapper=SequencePackingLossWrapper,
                data=BatchedDataDict)


@pytest.fixture(scope="module")
def batch():
    return random_batch(random.Random(7), groups=GROUPS, group_size=GROUP_SIZE)


def _stock(nemo, options: Options):
    return nemo["loss"](nemo["config"](**{**DEFAULTS, **options.keys}))


def _plugin(nemo, options: Options, mode: str, threshold=None):
    from megatron_pg_agg.integrations.nemo_rl.loss import PGAggLossFn
    from megatron_pg_agg.integrations.nemo_rl.weights import NemoRLSettings
    from megatron_pg_agg.integrations.objective import HostObjective

    return PGAggLossFn(_stock(nemo, options), NemoRLSettings(HostObjective(mode, MODES[mode]), threshold))


def _data(nemo, batch: dict):
    fields = {k: v for k, v in batch.items() if k != "group_of_row"}
    fields["row_index"] = torch.arange(batch["input_ids"].shape[0])
    return nemo["data"](fields)


def _shards(data, split: str, dp: int, gbs: int):
    if split == "dynamic":
        args = dict(input_key="input_ids", input_lengths_key="input_lengths", sequence_length_round=1,
                    max_tokens_per_microbatch=24)
        return data.shard_by_batch_size(dp, batch_size=gbs, dynamic_batching_args=args)[0]
    if split == "packing":
        args = dict(algorithm="modified_first_fit_decreasing", input_key="input_ids", input_lengths_key="input_lengths",
                    sequence_length_pad_multiple=1, max_tokens_per_microbatch=24)
        return data.shard_by_batch_size(dp, batch_size=gbs, sequence_packing_args=args)[0]
    return data.shard_by_batch_size(dp, batch_size=gbs)


def _microbatches(step, split: str):
    if split == "dynamic":
        return list(step.make_microbatch_iterator_with_dynamic_shapes())
    if split == "packing":
        return list(step.make_microbatch_iterator_for_packable_sequences())
    return list(step.make_microbatch_iterator(2))


def _call(nemo, loss_fn, lp, mb, split, seqs, toks):
    """One micro-batch's loss as NeMo-RL's LossPostProcessor computes it (CP 1: its factors cancel);
    per sequence through SequencePackingLossWrapper under packing."""
    if split != "packing":
        return loss_fn(lp[mb["row_index"]][:, : mb["input_ids"].shape[1] - 1], mb, seqs, toks)[0]

    def prepare(logits, data, loss_fn, **_):
        return {"next_token_logprobs": lp[data["row_index"]][:, : data["input_ids"].shape[1] - 1]}, data

    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(mb["input_lengths"], 0)])
    wrapper = nemo["wrapper"](loss_fn, prepare, cu_seqlens_q=cu, cu_seqlens_q_padded=cu)
    return wrapper(torch.zeros(1, int(cu[-1])), mb, seqs, toks)[0]


def run_steps(nemo, loss_fn, data, lp, *, split: str, dp: int, gbs: int, path: str = "train") -> list:
    """Each optimizer step's objective as NeMo-RL back-propagates it: the sum over DP ranks and
    micro-batches of the loss, with the step's counts (``train``) or placeholders 1 and one
    division by the loss type's count at the end (``split``)."""
    from nemo_rl.algorithms.loss.interfaces import LossType

    shards = _shards(data, split, dp, gbs)
    out = []
    for b in range(data.size // gbs):
        steps = [shard.get_batch(batch_idx=b, batch_size=gbs // dp) for shard in shards]
        seqs = sum(s["sample_mask"].sum() for s in steps)
        toks = sum((s["token_mask"][:, 1:] * s["sample_mask"].unsqueeze(-1)).sum() for s in steps)
        passed = (seqs, toks) if path == "train" else (torch.tensor(1.0), torch.tensor(1.0))
        total = sum(_call(nemo, loss_fn, lp, mb, split, *passed) for s in steps for mb in _microbatches(s, split))
        if path == "split":
            total = total / (toks if loss_fn.loss_type == LossType.TOKEN_LEVEL else seqs)
        out.append(total)
    return out


def _logprobs(batch: dict) -> torch.Tensor:
    gen = batch["generation_logprobs"][:, 1:].double()
    noise = torch.tensor([[random.Random(i * 31 + t).uniform(-0.04, 0.04) for t in range(gen.shape[1])]
                          for i in range(gen.shape[0])], dtype=torch.float64)
    return (gen + noise).requires_grad_(True)


def _check(nemo, batch, loss_fn, options, mode, *, split, dp, path="train", kept=None):
    from megatron_pg_agg.integrations.nemo_rl.plugin import step_batch

    gbs = batch["input_ids"].shape[0] // STEPS
    prepared = step_batch(_data(nemo, batch), loss_fn, gbs)
    worst = 0.0
    for b, got in enumerate(run_steps(nemo, loss_fn, prepared, lp := _logprobs(batch), split=split, dp=dp, gbs=gbs,
                                      path=path)):
        (grad,) = torch.autograd.grad(got, lp)
        lp_ref = lp.detach().clone().requires_grad_(True)
        want = reference_step(lp_ref, batch, list(range(b * gbs, (b + 1) * gbs)), Options(options.name,
                              {**DEFAULTS, **options.keys}), mode=mode, divisor=MODES[mode], kept_rows=kept)
        (want_grad,) = torch.autograd.grad(want, lp_ref)
        error = abs(float(got) - float(want)) / max(abs(float(want)), 0.01)
        grad_error = float((grad - want_grad).norm() / want_grad.norm().clamp(min=1e-30))
        assert error <= TOL and grad_error <= TOL, (options.name, mode, split, dp, path, b, float(got), float(want),
                                                    grad_error)
        worst = max(worst, error, grad_error)
    return worst


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("split", SPLITS)
def test_every_mode_and_split_equals_the_formulas_on_both_paths(nemo, batch, mode, split):
    """PPO under every mode: 2 optimizer steps, DP 1 and 2, fixed/dynamic/packed micro-batches, on
    train()'s counts and on the split path's placeholders. Catches a k_t computed per micro-batch or
    rank (W, G, S of a part), a field not travelling with its row through NeMo-RL's sorting and
    packing, a prompt group read from the wrong rows, or the split path divided by another count."""
    for dp in (1, 2):
        for path in ("train", "split"):
            _check(nemo, batch, _plugin(nemo, Options("ppo"), mode), Options("ppo"), mode, split=split, dp=dp,
                   path=path)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: o.name)
@pytest.mark.parametrize("mode", list(MODES))
def test_nemo_rls_own_options_are_exact_under_every_mode(nemo, batch, options, mode):
    """NeMo-RL's clip variants, CISPO, GSPO, REINFORCE, the on-policy ratio, the KL at token and
    sequence level, the importance-sampling correction with tis/icepop/seq-mask-tis, VAPO's NLL: each
    equals the formulas under every mode (DP 2, dynamic batching, both paths). Catches a sequence-level
    inner loss divided by S on the split path (S' not passed), the KL or NLL counted per micro-batch,
    or an option not homogeneous in the advantage."""
    for path in ("train", "split"):
        _check(nemo, batch, _plugin(nemo, options, mode), options, mode, split="dynamic", dp=2, path=path)


def _mult_prob_error_kept(batch: dict, threshold: float) -> torch.Tensor:
    """The rows NeMo-RL's documented sequence-level log-prob error masking keeps: the mean over the
    row's valid tokens of exp(|gen - prev|) at most ``threshold`` (rows without a valid token kept)."""
    valid = batch["token_mask"][:, 1:] * batch["sample_mask"].unsqueeze(-1)
    err = torch.exp((batch["generation_logprobs"] - batch["prev_logprobs"]).abs()[:, 1:])
    mean = (err * valid).sum(1) / valid.sum(1).clamp(min=1)
    return (mean <= threshold) | (valid.sum(1) == 0)


@pytest.mark.parametrize("mode", list(MODES))
def test_the_filtered_numerator_keeps_the_rejected_rows_in_the_denominator(nemo, batch, mode):
    """loss_fn.pg_agg.seq_logprob_error_threshold: the rows NeMo-RL's own masking rejects leave the
    numerator only (the reference: kept rows from the documented rule). Catches the rejected rows
    dropped from W and the unit sizes (NeMo-RL's survivor denominator)."""
    threshold = 1.03
    kept = _mult_prob_error_kept(batch, threshold)
    assert 0 < int(kept.sum()) < len(kept) - 1  # the threshold rejects some rows, not all
    loss_fn = _plugin(nemo, Options("ppo"), mode, threshold)
    for path in ("train", "split"):
        _check(nemo, batch, loss_fn, Options("ppo"), mode, split="packing", dp=2, path=path, kept=kept)


def _stock_steps(nemo, batch, options, split, dp):
    data = _data(nemo, batch)
    gbs = batch["input_ids"].shape[0] // STEPS
    lp = _logprobs(batch)
    return [float(v) for v in run_steps(nemo, _stock(nemo, options), data, lp, split=split, dp=dp, gbs=gbs)], lp


def test_control_nemo_rls_stock_losses_are_token_and_seq_mean(nemo):
    """NeMo-RL's stock token-level loss equals the plug-in's token_mean, and its sequence-level loss the
    plug-in's seq_mean on a batch without an empty response (to 1e-7: NeMo-RL adds 1e-8 to each count
    it divides by); its stock loss differs from prompt_mean and constant by more than 1%; with an empty
    response (sample_mask 1, no loss token) its sequence level divides by every sample, seq_mean by
    the active ones."""
    full = random_batch(random.Random(11), groups=GROUPS, group_size=GROUP_SIZE, empty_response=False)
    for options, mode in ((Options("ppo"), "token_mean"), (Options("seq", dict(token_level_loss=False)), "seq_mean")):
        stock, lp = _stock_steps(nemo, full, options, "dynamic", 2)
        gbs = full["input_ids"].shape[0] // STEPS
        for b, value in enumerate(stock):
            want = reference_step(lp, full, list(range(b * gbs, (b + 1) * gbs)),
                                  Options("", {**DEFAULTS, **options.keys}), mode=mode)
            assert abs(value - float(want)) <= 1e-7 * max(abs(float(want)), 1.0), (mode, value, float(want))
        for other in ("prompt_mean", "constant"):
            for b, value in enumerate(stock):
                want = reference_step(lp, full, list(range(b * gbs, (b + 1) * gbs)),
                                      Options("", {**DEFAULTS, **options.keys}), mode=other, divisor=MODES[other])
                assert abs(value - float(want)) > 0.01 * abs(float(want)), (other, value, float(want))
    empty = random_batch(random.Random(11), groups=GROUPS, group_size=GROUP_SIZE, empty_response=True)
    stock, lp = _stock_steps(nemo, empty, Options("seq", dict(token_level_loss=False)), "fixed", 1)
    gbs = empty["input_ids"].shape[0] // STEPS
    ours = [float(reference_step(lp, empty, list(range(b * gbs, (b + 1) * gbs)),
                                 Options("", dict(DEFAULTS, token_level_loss=False)), mode="seq_mean"))
            for b in range(STEPS)]
    assert any(abs(a - b) > 1e-6 for a, b in zip(stock, ours)), (stock, ours)


def test_control_nemo_rls_vapo_nll_depends_on_the_split_and_the_plugins_does_not(nemo, batch):
    """NeMo-RL #3791: its positive-example NLL divides by each micro-batch's correct tokens, so the same
    step gives another objective under another split; the plug-in's is the step's token mean under
    every split (checked against the formulas above)."""
    options = Options("vapo_nll", dict(positive_example_nll_weight=0.5))
    stock = {split: _stock_steps(nemo, batch, options, split, 2)[0] for split in SPLITS}
    assert max(abs(a - b) for a, b in zip(stock["fixed"], stock["packing"])) > 1e-3, stock
    for split in SPLITS:
        _check(nemo, batch, _plugin(nemo, options, "token_mean"), options, "token_mean", split=split, dp=2)
