"""The audit of NeMo-RL (0.6 @ 7ea279a: its loader, ``Policy._shard_for_train``, ``BatchedDataDict``'s
micro-batch iterators, ``SequencePackingLossWrapper``, ``ClippedPGLossFn``): the command in-process (NeMo-RL
imports once per module, ~10 s) on NeMo-RL's own ``examples/configs/grpo_math_1B.yaml`` at a small size.

Catches: step counts taken per micro-batch or per rank instead of over the step (the token mean would move with
the split and leave the float64 reference), steps that are not NeMo-RL's chunks of
``policy.train_global_batch_size`` rows (the cut groups), a sequence-level setting read as a token mean (its
length ratio), a plug-in line that is not exact, and an unknown key that is not refused with Hydra's message.
Needs the NeMo-RL checkout (``MEGATRON_PG_AGG_NEMO_RL``) and its stack; skips without them, fails under
MEGATRON_PG_AGG_REQUIRE_NEMO_RL=1 (as tests/unit/integrations/test_nemo_rl_loss.py).
"""
from __future__ import annotations

import json

import pytest
import torch

from megatron_pg_agg.audit import cli
from tests.support.optional import require_nemo_rl

pytestmark = pytest.mark.optional_stack

SMALL = ["policy.max_total_sequence_length=80", "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=4",
         "policy.train_global_batch_size=16", "policy.train_micro_batch_size=2",
         "loss_fn.reference_policy_kl_penalty=0"]
CLIP = 0.2  # grpo_math_1B.yaml's loss_fn.ratio_clip_min / ratio_clip_max
TOL = 1e-6  # NeMo-RL's loss runs in float32 (1e-7 of an order-1 term); the reference in float64


@pytest.fixture(scope="module")
def nemo():
    require_nemo_rl()


def _audit(overrides: list):
    options = cli.parser().parse_intermixed_args(["nemo-rl", *overrides])
    return cli.audit("nemo-rl", options, [])


def _reference(batch, rows: list, token_level: bool) -> tuple:
    """``(J, dJ/dlogp over every row)`` of one step, float64, from the formulas: PPO's clipped term per
    token, summed over the step's valid tokens and divided by their count (token level), or each row's
    token mean averaged over the step's rows with a valid token (sequence level)."""
    leaves = [lp.double().clone().requires_grad_(True) for lp in batch.logprobs]
    terms, tokens, rows_with_tokens = [], 0, 0
    for i in rows:
        mask = batch.masks[i].double()
        if not bool(mask.any()):
            continue
        adv = float(batch.advantages[i])
        ratio = torch.exp(leaves[i] - batch.old_logprobs[i].double())
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
        terms.append((loss * mask).sum() if token_level else (loss * mask).sum() / mask.sum())
        tokens += int(mask.sum())
        rows_with_tokens += 1
    objective = torch.stack(terms).sum() / (tokens if token_level else rows_with_tokens)
    grads = torch.autograd.grad(objective, leaves, allow_unused=True)
    return float(objective.detach()), torch.cat([torch.zeros(lp.numel(), dtype=torch.float64) if g is None else g
                                        for g, lp in zip(grads, batch.logprobs)])


def _check_reference(report, batch, token_level: bool) -> None:
    for result in report.splits:
        for s, rows in enumerate(result.members):
            want, want_w = _reference(batch, list(rows), token_level)
            got, got_w = float(result.steps[s]), result.weights[s]
            assert abs(got - want) <= TOL * max(abs(want), 0.1), (result.split.name, s, got, want)
            assert float((got_w - want_w).norm() / want_w.norm()) <= TOL, result.split.name


def test_the_token_level_loss_does_not_move_and_is_the_step_token_mean(nemo):
    report, batch = _audit(SMALL)
    names = [r.split.name for r in report.splits]
    assert names[0] == "packing 160 tokens, DP 1" and "dynamic 160 tokens, DP 2" in names, names
    assert len(report.splits) == 10 and not report.refused
    assert report.spread < 1e-6 and report.plugin_spread < 1e-6
    assert abs(report.length_weight_ratio - 1) < 1e-6
    assert not report.cut_groups()
    _check_reference(report, batch, token_level=True)


def test_the_sequence_level_loss_is_a_mean_of_sample_means(nemo):
    """Split-invariant too (NeMo-RL divides by the step's global_valid_seqs), but a token of the longest response
    weighs less than one of the shortest: the ratio of their lengths, as the reference gives."""
    report, batch = _audit([*SMALL, "loss_fn.token_level_loss=false"])
    assert report.spread < 1e-6 and report.plugin_spread < 1e-6
    assert report.length_weight_ratio < 0.5, report.length_weight_ratio
    _check_reference(report, batch, token_level=False)
    assert "mean of sample means" in report.stock


def test_a_global_batch_that_is_not_a_multiple_of_the_group_cuts_groups(nemo):
    """NeMo-RL's loader takes policy.train_global_batch_size=8 with 6 generations per prompt (24 rows, 3 steps):
    groups 1 (rows 6-11) and 2 (rows 12-17) straddle a step boundary in every split; the plug-in's token mean
    over the same steps is exact."""
    report, _ = _audit([*SMALL, "grpo.num_generations_per_prompt=6", "grpo.num_prompts_per_step=4",
                        "policy.train_global_batch_size=8"])
    cut = report.cut_groups()
    assert set(cut) == {r.split.name for r in report.splits}, cut
    assert all(len(groups) == 2 for groups in cut.values()), cut
    assert all(len(r.members) == 3 for r in report.splits)
    assert report.plugin_spread < 1e-6


def test_a_key_nemo_rl_does_not_know_is_refused_with_hydras_message(nemo, capsys):
    assert cli.main(["nemo-rl", *SMALL, "loss_fn.token_levl_loss=false"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("refusing to audit nemo-rl: NeMo-RL's config:"), last
    assert "Could not override 'loss_fn.token_levl_loss'" in last, last


def test_the_json_has_the_keys_of_every_host(nemo, tmp_path, capsys):
    path = tmp_path / "audit.json"
    assert cli.main(["nemo-rl", *SMALL, "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert set(data) == {"host", "stock", "settings", "rows", "tokens", "splits", "spread", "cut_groups",
                         "length_weight_ratio", "fix", "plugin_splits", "plugin_spread", "refused_splits",
                         "other_step_membership", "seconds"}
    assert data["host"] == "nemo-rl" and "++loss_fn.pg_agg.mode=token_mean" in data["fix"]
    assert "megatron_pg_agg audit: nemo-rl" in capsys.readouterr().out


def test_a_missing_checkout_is_one_line_naming_the_install(tmp_path, capsys):
    """No NeMo-RL needed: the checkout is checked before anything imports it."""
    assert cli.main(["nemo-rl", "--", "--nemo-rl", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a NeMo-RL checkout" in err[0] and "to install:" in err[0], err


def test_a_micro_batch_size_nemo_rl_asserts_against_is_listed_as_refused(nemo):
    """16 rows per step at DP 1 do not cut into micro-batches of 3 (nor of 6): NeMo-RL's make_microbatch_iterator
    asserts; the configured split (sequence packing) and the rest are measured."""
    report, _ = _audit([*SMALL, "policy.train_micro_batch_size=3"])
    assert set(report.refused) == {"micro-batch 3, DP 1", "micro-batch 6, DP 1", "micro-batch 3, DP 2",
                                   "micro-batch 6, DP 2"}, report.refused
    assert "not a multiple of the provided microbatch size (3)" in report.refused["micro-batch 3, DP 1"]
    assert report.splits[0].split.name == "packing 240 tokens, DP 1" and report.spread < 1e-6
