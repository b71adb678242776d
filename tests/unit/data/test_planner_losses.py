"""Step planner and per-token PG losses, single process: every cut of a step gives the same J.

The model is replaced by a fixed table of logits per (rollout, position), so the check isolates
planning, CP sharding and the loss; the multi-process Megatron suite checks the rest.
"""
import math

import pytest
import torch

from megatron_pg_agg.core.losses import PGLossConfig, pg_loss_sum, vocab_parallel_logprobs
from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.data.rollouts import PlanError, Rollout, RolloutBatch
from tests.support.reference import reference_objective
from tests.support.rollouts import VOCAB, fixed_step

MODES = {
    "token_mean": {},
    "seq_mean": {},
    "prompt_mean": {},
    "constant": {"divisor": 16.0},
}


def _logit_table(rollouts):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(len(r.prompt_ids) + len(r.response_ids), VOCAB, generator=g) * 2 for r in rollouts]


def _reference_J(rollouts, table, cfg):
    """Independent float64 reference: python per-token PPO, then tests/support/reference.py's aggregation."""
    first_seen = {}
    for r in rollouts:
        first_seen.setdefault(r.group_id, len(first_seen))
    order = sorted(range(len(rollouts)), key=lambda i: (first_seen[rollouts[i].group_id], i))
    losses, num, den, lengths, groups, kl_sum, ent_sum = [], [], [], [], [], 0.0, 0.0
    for k, i in enumerate(order):
        r = rollouts[i]
        if k and r.group_id == rollouts[order[k - 1]].group_id:
            groups[-1] += 1
        else:
            groups.append(1)
        logp_all = torch.log_softmax(table[i].double(), -1)
        p = len(r.prompt_ids)
        for j, tok in enumerate(r.response_ids):
            lp = float(logp_all[p + j - 1, tok])
            ratio = math.exp(lp - r.old_logprobs[j])
            a = r.advantages[j]
            clipped = min(max(ratio, 1 - cfg.clip_eps_low), 1 + cfg.clip_eps_high)
            pg = max(-a * ratio, -a * clipped)
            if cfg.dual_clip is not None and a < 0:
                pg = min(pg, -a * cfg.dual_clip)
            losses.append(pg)
            den.append(bool(r.loss_mask[j]))
            num.append(bool(r.loss_mask[j] and r.numerator_mask[j]))
            if r.loss_mask[j]:
                lr = lp - r.ref_logprobs[j]
                kl_sum += math.exp(-lr) + lr - 1
                probs = logp_all[p + j - 1].exp()
                ent_sum += float(-(probs * logp_all[p + j - 1]).sum())
        lengths.append(len(r.response_ids))
    J, W = reference_objective(torch.tensor(losses, dtype=torch.float64), num, den, lengths, groups,
                               cfg.mode, cfg.divisor)
    D = sum(den)
    J = float(J)
    if W:
        J += cfg.kl_coef * kl_sum / D - cfg.entropy_coef * ent_sum / D
    return J, W


def _planned_J(rollouts, table, cfg, plan_cfg):
    sums, count = 0.0, 0
    reports = {}
    for cp_rank in range(plan_cfg.cp_size):
        plan = plan_step(rollouts, cfg, plan_cfg, cp_rank=cp_rank)
        for rank_mbs in plan.microbatches:
            for mb in rank_mbs:
                # gather this microbatch's logits from the table, padded rows random
                rows = []
                pads = mb.cu_seqlens_padded.tolist()
                for s, seq in enumerate(mb.sequence_ids):
                    n = pads[s + 1] - pads[s]
                    t = table[seq]
                    rows.append(torch.cat([t, torch.randn(n - t.shape[0], VOCAB)]))
                full = torch.cat(rows)
                if plan_cfg.cp_size > 1:
                    from megatron_pg_agg.core.context_parallel import cp_partition_index
                    full = full[cp_partition_index(
                        [b - a for a, b in zip(pads[:-1], pads[1:])], plan_cfg.cp_size, cp_rank)]
                logp, ent = vocab_parallel_logprobs(full, mb.labels[0], with_entropy=cfg.needs_entropy)
                loss, c, report = pg_loss_sum(logp, mb, plan.totals, cfg, entropy=ent)
                assert c.dtype == torch.int32
                sums += float(loss)
                count += int(c)
                for k, v in report.items():
                    reports[k] = reports.get(k, 0) + v.double()
    return sums / max(count, 1), count, reports, plan


LAYOUTS = [
    PlanConfig(dp_size=1, num_microbatches=1),
    PlanConfig(dp_size=1, num_microbatches=3),
    PlanConfig(dp_size=2, num_microbatches=1),
    PlanConfig(dp_size=2, num_microbatches=3),
    PlanConfig(dp_size=3, num_microbatches=2, tp_size=2, sequence_parallel=True),
    PlanConfig(dp_size=1, num_microbatches=8),
    PlanConfig(dp_size=2, num_microbatches=2, cp_size=2),
    PlanConfig(dp_size=1, max_tokens_per_microbatch=48, cp_size=2, tp_size=2, sequence_parallel=True),
]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("extra", [False, True], ids=["pg", "pg+kl+entropy"])
def test_every_cut_of_the_step_gives_the_reference_objective(mode, extra):
    rollouts = fixed_step()
    table = _logit_table(rollouts)
    cfg = PGLossConfig(mode=mode, clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0,
                       kl_coef=0.1 if extra else 0.0, entropy_coef=0.01 if extra else 0.0,
                       **MODES[mode])
    ref_J, ref_W = _reference_J(rollouts, table, cfg)
    for plan_cfg in LAYOUTS:
        J, W, reports, plan = _planned_J(rollouts, table, cfg, plan_cfg)
        assert W == ref_W == plan.totals.pg_weight, plan_cfg
        assert J == pytest.approx(ref_J, rel=1e-6, abs=1e-7), plan_cfg
        obj = reports["objective"]
        assert float(obj[0] / obj[1]) == pytest.approx(ref_J, rel=1e-6), plan_cfg


def test_plan_is_deterministic_balanced_and_padded():
    rollouts = fixed_step()
    cfg = PGLossConfig(mode="prompt_mean", kl_coef=0.1)
    plan_cfg = PlanConfig(dp_size=2, num_microbatches=3, tp_size=2, sequence_parallel=True, cp_size=2)
    a = plan_step(rollouts, cfg, plan_cfg)
    b = plan_step(list(rollouts), cfg, plan_cfg)
    for ra, rb in zip(a.microbatches, b.microbatches):
        for ma, mb in zip(ra, rb):
            assert ma.sequence_ids == mb.sequence_ids and torch.equal(ma.tokens, mb.tokens)
    assert plan_cfg.pad_multiple == 4
    for rank in a.microbatches:
        for mb in rank:
            assert all(x % 4 == 0 for x in mb.cu_seqlens_padded.tolist())
            assert (mb.cu_seqlens <= mb.cu_seqlens_padded).all()
    # every rollout is placed exactly once, and each bin holds exactly the padded tokens of its
    # sequences (this CP rank holds 1/cp of them)
    cp, bins = plan_cfg.cp_size, plan_cfg.dp_size * plan_cfg.num_microbatches
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rollouts]
    padded = [-(-n // 4) * 4 for n in lengths]
    placed = [s for rank in a.microbatches for mb in rank for s in mb.sequence_ids]
    assert sorted(placed) == list(range(len(rollouts))), placed
    for r, rank in enumerate(a.microbatches):
        for m, mb in enumerate(rank):
            ids = mb.sequence_ids
            assert a.bin_tokens[r][m] == sum(padded[s] for s in ids) == int(mb.cu_seqlens_padded[-1]), (r, m)
            assert torch.diff(mb.cu_seqlens_padded).tolist() == [padded[s] for s in ids]
            assert torch.diff(mb.cu_seqlens).tolist() == [lengths[s] for s in ids]
            assert mb.num_tokens * cp == a.bin_tokens[r][m]
    # balance: the bin loads are those of a longest-first greedy onto the lightest bin computed
    # here independently (its multiset of loads does not depend on how ties are broken)
    greedy = [0] * bins
    for n in sorted(padded, reverse=True):
        greedy[greedy.index(min(greedy))] += n
    loads = [t for row in a.bin_tokens for t in row]
    assert sorted(loads) == sorted(greedy), (loads, greedy)
    assert a.stats["microbatch_balance"] == pytest.approx(max(greedy) / (sum(greedy) / bins))
    # the weights were computed for the whole step: a prompt group lands in several microbatches
    where = {}
    for r, rank in enumerate(a.microbatches):
        for m, mb in enumerate(rank):
            for s in mb.sequence_ids:
                where.setdefault(rollouts[s].group_id, set()).add((r, m))
    assert any(len(v) > 1 for v in where.values())


def test_capacity_and_empty_bins_are_refused_clearly():
    rollouts = fixed_step()
    cfg = PGLossConfig()
    longest = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    with pytest.raises(PlanError, match="max_tokens_per_microbatch"):
        plan_step(rollouts, cfg, PlanConfig(max_tokens_per_microbatch=longest - 1))
    with pytest.raises(PlanError, match="empty"):
        plan_step(rollouts, cfg, PlanConfig(dp_size=4, num_microbatches=8))
    with pytest.raises(PlanError, match="no rollouts"):
        plan_step([], cfg, PlanConfig())
    bad = Rollout([1, 2], [3, 4], [1, 1], [0.5], [-1.0, -1.0], group_id=0)
    with pytest.raises(PlanError, match="^rollout 0: advantages has 1 entries but response_ids has 2") as excinfo:
        plan_step([bad], cfg, PlanConfig())
    assert (excinfo.value.rollout, excinfo.value.field) == (0, "advantages")
    with pytest.raises(PlanError, match="ref_logprobs is missing"):
        plan_step(fixed_step(with_ref=False), PGLossConfig(kl_coef=0.1), PlanConfig())


def _with_rollout_logprobs():
    rollouts = fixed_step()
    for r in rollouts:
        r.rollout_logprobs = [min(lp + 0.3 * ((j % 3) - 1), 0.0) for j, lp in enumerate(r.old_logprobs)]
    return rollouts


CORRECTED = PGLossConfig(mode="seq_mean", kl_coef=0.1, rollout_correction="token_mask",
                         rollout_correction_max=1.2, rollout_correction_min=0.8)


@pytest.mark.parametrize("cfg", [PGLossConfig(kl_coef=0.1), CORRECTED], ids=["plain", "rollout_correction"])
def test_the_planner_does_not_recheck_a_rollout_batch(monkeypatch, cfg):
    """A RolloutBatch checks itself once, when built; planning it (twice here, as the trainer
    plans every iteration) must add 0 checker calls. Catches ``batch.validate(...)``, a re-built
    ``RolloutBatch(...)`` or ``dataclasses.replace(batch, numerator_mask=...)`` (which re-runs
    ``__post_init__``: the rollout-correction case) put back in ``checked_batch``."""
    calls = {"structure": 0, "values": 0}
    for name, key in (("_check_structure", "structure"), ("_check_values", "values")):
        original = getattr(RolloutBatch, name)

        def counted(self, _original=original, _key=key):
            calls[_key] += 1
            return _original(self)

        monkeypatch.setattr(RolloutBatch, name, counted)
    batch = RolloutBatch.from_rollouts(_with_rollout_logprobs(), vocab_size=VOCAB)
    assert calls == {"structure": 1, "values": 1}  # checked where it was built
    plans = [plan_step(batch, cfg, PlanConfig(dp_size=2, num_microbatches=2)) for _ in range(2)]
    assert calls == {"structure": 1, "values": 1}, "the planner re-checked a RolloutBatch"
    assert plans[0].totals == plans[1].totals
    if cfg.rollout_correction:  # the correction narrowed the plan's numerator, not the batch's
        planned = sum(int(mb.numerator_mask.sum()) for row in plans[0].microbatches for mb in row)
        assert planned < int(batch.numerator_mask.sum())
    plan_step(_with_rollout_logprobs(), cfg, PlanConfig())  # a list of Rollout is packed and checked
    assert calls == {"structure": 2, "values": 2}


def test_a_batch_changed_after_construction_is_planned_as_it_is():
    """The planner trusts a RolloutBatch: a value changed in place after construction is planned
    unchecked (the change shows in the microbatch). Catches a value re-check put back in
    ``checked_batch``, which would refuse this plan; token ids are still checked against
    ``PlanConfig.vocab_size`` (the vocabulary is known there), naming rollout, field and position."""
    rollouts = fixed_step()
    batch = RolloutBatch.from_rollouts(rollouts)
    i = next(i for i, r in enumerate(rollouts) if i > 0 and sum(r.loss_mask))
    j = list(rollouts[i].loss_mask).index(1)
    batch.old_logprobs[int(batch.response_lengths[:i].sum()) + j] = 0.5  # refused at construction
    plan = plan_step(batch, PGLossConfig(), PlanConfig())
    assert any(bool((mb.old_logprobs == 0.5).any()) for row in plan.microbatches for mb in row)
    batch.response_tokens[int(batch.response_lengths[:i].sum()) + j] = VOCAB
    plan_step(batch, PGLossConfig(), PlanConfig())  # no vocabulary: nothing to check it against
    words = rf"^rollout {i}: response_ids\[{j}\]={VOCAB} is outside the vocabulary"
    with pytest.raises(PlanError, match=words) as excinfo:
        plan_step(batch, PGLossConfig(), PlanConfig(vocab_size=VOCAB))
    assert (excinfo.value.rollout, excinfo.value.field, excinfo.value.position) == (i, "response_ids", j)


def test_vocab_parallel_logprobs_single_rank_matches_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(11, 37, generator=g) * 3
    target = torch.randint(0, 37, (11,), generator=g)
    before = logits.clone()
    logp, ent = vocab_parallel_logprobs(logits, target, with_entropy=True)
    ref = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(logp.double(), ref.gather(-1, target[:, None])[:, 0], atol=1e-5)
    assert torch.allclose(ent.double(), -(ref.exp() * ref).sum(-1), atol=1e-5)
    assert torch.equal(logits, before), "input logits must not be modified"


def test_loss_config_refuses_bad_combinations():
    with pytest.raises(ValueError, match="divisor"):
        PGLossConfig(mode="constant")
    with pytest.raises(ValueError, match="divisor"):
        PGLossConfig(mode="seq_mean", divisor=3)
    with pytest.raises(ValueError, match="dual_clip"):
        PGLossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="kl_estimator"):
        PGLossConfig(kl_estimator="k9")
    assert PGLossConfig(mode="dr_grpo", divisor=8).mode == "constant"
