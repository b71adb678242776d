"""Sequence-level policy losses (gspo, gmpo, cispo, and ppo) and the rollout-engine corrections,
against an independent float64 reference written from the formulas (values and gradients).

The reference below shares no code with the package: per-sequence Python lists, float64 torch
only for autograd, the aggregation modes written out from the README's contract table."""
from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_pg_agg import token_weights
from megatron_pg_agg.core.losses import LossPart, PGLossConfig, SequenceStatistic, StepTotals, pg_loss_sum
from megatron_pg_agg.core.modes import MODES
from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.data.rollouts import Rollout

POLICIES = ("ppo", "gspo", "gmpo", "cispo")
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _step(seed: int):
    """Sequences in ragged groups: per token (logp, old, A, n, d); one sequence with no valid token,
    filtered numerator tokens, positive and negative advantages (constant within a sequence for
    half of the groups, varying per token for the rest)."""
    rng = random.Random(seed)
    seqs, groups = [], []
    for g, size in enumerate((3, 1, 2, 4)):
        for k in range(size):
            length = rng.randint(2, 9)
            adv = rng.uniform(-1, 1)
            tokens = []
            for _ in range(length):
                d = 0 if (g == 1 and k == 0) else int(rng.random() > 0.15)  # group 1: no valid token
                n = d if rng.random() > 0.2 else 0
                old = -rng.uniform(0.5, 3.0)
                logp = old + rng.uniform(-0.4, 0.4)
                a = adv if g % 2 == 0 else rng.uniform(-1, 1)
                rollout = min(old + rng.uniform(-1.0, 1.0), -0.01)
                tokens.append(dict(logp=logp, old=old, adv=a, n=n, d=d, rollout=rollout))
            seqs.append(tokens)
            groups.append(g)
    return seqs, groups


def _reference_token_losses(seq, policy, logp):
    """float64 per-token losses of one sequence (list of tensors), from the formulas of docs/policy-losses.md."""
    n_i = sum(t["n"] for t in seq)
    out = []
    x = [logp[j] - seq[j]["old"] for j in range(len(seq))]
    if policy == "gspo":
        s_i = math.exp(sum(float(x[j]) for j, t in enumerate(seq) if t["n"]) / n_i) if n_i else 0.0
    if policy == "gmpo":
        def m_of(j):
            a = 1.0 if seq[j]["adv"] >= 0 else -1.0
            clipped = torch.clamp(x[j], -EPS_LOW, EPS_HIGH)
            return a * torch.minimum(a * x[j], a * clipped)
        ms = [m_of(j) for j in range(len(seq))]
        mean_m = sum(float(ms[j]) for j, t in enumerate(seq) if t["n"]) / n_i if n_i else 0.0
    for j, t in enumerate(seq):
        a = t["adv"]
        if policy == "ppo":
            r = torch.exp(x[j])
            loss = torch.maximum(-a * r, -a * torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH))
        elif policy == "gspo":
            r = torch.exp(logp[j] - logp[j].detach()) * s_i
            loss = torch.maximum(-a * r, -a * torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH))
        elif policy == "gmpo":
            loss = -a * torch.exp(ms[j] - ms[j].detach() + mean_m)
        else:  # cispo
            w = float(torch.clamp(torch.exp(x[j]), 1 - EPS_LOW, 1 + EPS_HIGH))
            loss = -w * a * logp[j]
        out.append(loss)
    return out


def _reference_objective(seqs, groups, mode, policy, logps, divisor=8.0, pg_weights=None, numerators=None):
    """J by the contract: token_mean sum n l / sum d; seq_mean mean over active sequences of
    N_s / D_s; prompt_mean the same over groups (tokens pooled); constant sum n l / (active * L)."""
    per_seq_num, per_seq_den = [], []
    for i, seq in enumerate(seqs):
        if numerators is not None:
            seq = [dict(t, n=numerators[i][j]) for j, t in enumerate(seq)]
        losses = _reference_token_losses(seq, policy, logps[i])
        num = sum((losses[j] * (1.0 if pg_weights is None else pg_weights[i][j])
                   for j, t in enumerate(seq) if t["n"]), torch.zeros((), dtype=torch.float64))
        per_seq_num.append(num)
        per_seq_den.append(sum(t["d"] for t in seq))
    active = [i for i, d in enumerate(per_seq_den) if d > 0]
    if mode == "token_mean":
        return sum(per_seq_num) / sum(per_seq_den)
    if mode == "seq_mean":
        return sum(per_seq_num[i] / per_seq_den[i] for i in active) / len(active)
    if mode == "constant":
        return sum(per_seq_num) / (len(active) * divisor)
    by_group = {}
    for i, g in enumerate(groups):
        num, den = by_group.get(g, (0.0, 0))
        by_group[g] = (num + per_seq_num[i], den + per_seq_den[i])
    live = [num / den for num, den in by_group.values() if den > 0]
    return sum(live) / len(live)


def _grads(logps):
    return torch.cat([lp.grad if lp.grad is not None else torch.zeros_like(lp) for lp in logps])


def _library(seqs, groups, mode, policy, parts, divisor=8.0):
    """J and dJ/dlogp from pg_loss_sum, the step cut into ``parts`` (lists of sequence indices)."""
    flat = [t for seq in seqs for t in seq]
    lengths = [len(s) for s in seqs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    n = torch.tensor([bool(t["n"]) for t in flat])
    d = torch.tensor([bool(t["d"]) for t in flat])
    sizes = [groups.count(g) for g in dict.fromkeys(groups)]
    weights = token_weights(n, mode=mode, cu_seqlens=cu, group_sizes=sizes, denominator_mask=d,
                            divisor=divisor if mode == "constant" else None)
    totals = StepTotals(pg_weight=int(weights.count.sum()), valid_tokens=int(d.sum()))
    cfg = PGLossConfig(mode=mode, divisor=divisor if mode == "constant" else None, clip_eps_low=EPS_LOW,
                       clip_eps_high=EPS_HIGH, policy_loss=policy, report_entropy=False)
    logp = torch.tensor([t["logp"] for t in flat], dtype=torch.float32, requires_grad=True)
    field = {k: torch.tensor([t[k] for t in flat], dtype=torch.float32) for k in ("old", "adv")}
    loss_total, count_total = 0.0, 0
    for part in parts:
        idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in part])
        local_cu = torch.tensor([0, *torch.tensor([lengths[i] for i in part]).cumsum(0).tolist()])
        seq_n = torch.tensor([float(sum(t["n"] for t in seqs[i])) for i in part])
        part_inputs = LossPart(old_logprobs=field["old"][idx], advantages=field["adv"][idx],
                               numerator_mask=n[idx], denominator_mask=d[idx], token_weights=weights[idx])
        loss, count, report = pg_loss_sum(logp[idx], part_inputs, totals, cfg,
                                          sequences=SequenceStatistic(local_cu, seq_n, idx.numel()))
        loss_total = loss_total + loss
        count_total += int(count)
    objective = loss_total / count_total
    objective.backward()
    return float(objective.detach()), logp.grad.double(), cu


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_each_policy_loss_matches_the_float64_reference_in_every_mode(policy, mode):
    """Values and gradients, the step cut into two parts of whole sequences: a wrong sign, clip,
    sequence mean (e.g. over d instead of n, or over the part instead of the sequence) or a
    missing stop-gradient fails."""
    for seed in range(3):
        seqs, groups = _step(seed)
        parts = [list(range(0, 5)), list(range(5, len(seqs)))]
        got, grad, cu = _library(seqs, groups, mode, policy, parts)
        logps = [torch.tensor([t["logp"] for t in seq], dtype=torch.float64, requires_grad=True) for seq in seqs]
        ref = _reference_objective(seqs, groups, mode, policy, logps)
        ref.backward()
        ref_grad = _grads(logps)
        assert got == pytest.approx(float(ref), rel=1e-5, abs=1e-7), (seed, policy, mode)
        assert torch.allclose(grad, ref_grad, rtol=1e-4, atol=1e-6), (seed, (grad - ref_grad).abs().max())


def test_gspo_under_seq_mean_is_the_papers_sequence_level_gspo():
    """With sequence-constant advantages and no filtering, GSPO-token under seq_mean has the value
    and gradient of J = mean_i min(s_i A_i, clip(s_i) A_i) (a loss: its negative), s_i =
    exp(mean_t log(pi/pi_old)) differentiated as a whole."""
    seqs, groups = _step(11)
    seqs = [[dict(t, adv=seq[0]["adv"], n=1, d=1) for t in seq] for seq in seqs]
    got, grad, _ = _library(seqs, groups, "seq_mean", "gspo", [list(range(len(seqs)))])
    logps = [torch.tensor([t["logp"] for t in seq], dtype=torch.float64, requires_grad=True) for seq in seqs]
    terms = []
    for seq, lp in zip(seqs, logps):
        s = torch.exp((lp - torch.tensor([t["old"] for t in seq], dtype=torch.float64)).mean())
        a = seq[0]["adv"]
        terms.append(torch.maximum(-a * s, -a * torch.clamp(s, 1 - EPS_LOW, 1 + EPS_HIGH)))
    paper = sum(terms) / len(terms)
    paper.backward()
    assert got == pytest.approx(float(paper), rel=1e-5)
    assert torch.allclose(grad, _grads(logps), rtol=1e-4, atol=1e-7)


def test_a_sequence_split_without_its_statistic_is_not_gspo():
    """Control: cutting a sequence in two parts, each with its own partial statistic (what a CP
    shard without the all-reduce would see), changes the value: the statistic must be whole."""
    seqs, groups = _step(3)
    whole, _, _ = _library(seqs, groups, "seq_mean", "gspo", [list(range(len(seqs)))])
    half = [dict(t) for t in seqs[0]]
    cut = len(half) // 2
    split = [half[:cut], half[cut:]] + seqs[1:]
    got, _, _ = _library(split, [groups[0], *groups], "seq_mean", "gspo", [list(range(len(split)))])
    assert got != pytest.approx(whole, rel=1e-4)


def _rollouts(seed: int):
    seqs, groups = _step(seed)
    rng = random.Random(seed)
    out = []
    for seq, g in zip(seqs, groups):
        out.append(Rollout(
            prompt_ids=[rng.randrange(50) for _ in range(3)], response_ids=[rng.randrange(50) for _ in seq],
            loss_mask=[t["d"] for t in seq], advantages=[t["adv"] for t in seq],
            old_logprobs=[t["old"] for t in seq], numerator_mask=[t["n"] for t in seq],
            rollout_logprobs=[t["rollout"] for t in seq], group_id=g))
    return seqs, groups, out


def _reference_correction(seqs, kind, cap, floor):
    """Per sequence: (weights, numerator) from delta_t = old - rollout, as docs/policy-losses.md states, and
    the counts of valid tokens masked and truncated."""
    weights, numerators, masked, truncated = [], [], 0, 0
    for seq in seqs:
        deltas = [t["old"] - t["rollout"] for t in seq]
        if kind.startswith("sequence"):
            valid = [dl for dl, t in zip(deltas, seq) if t["d"]]
            mean = sum(valid) / len(valid) if valid else 0.0
            ratios = [math.exp(mean)] * len(seq)
        else:
            ratios = [math.exp(dl) for dl in deltas]
        if kind.endswith("truncate"):
            weights.append([min(r, cap) for r in ratios])
            numerators.append([t["n"] for t in seq])
            truncated += sum(1 for r, t in zip(ratios, seq) if t["d"] and r > cap)
        else:
            weights.append([1.0] * len(seq))
            numerators.append([t["n"] if floor <= r <= cap else 0 for r, t in zip(ratios, seq)])
            masked += sum(1 for r, t in zip(ratios, seq) if t["d"] and not floor <= r <= cap)
    return weights, numerators, masked, truncated


@pytest.mark.parametrize("kind", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_rollout_corrections_match_the_reference_through_the_planner(kind):
    """The planner's per-token weights and numerator (gathered back to rollout order) equal the
    reference; the denominator is untouched; the reported counts are the reference's; and the
    objective computed from the planned microbatches equals the reference objective."""
    cap, floor = 1.5, 0.6
    seqs, groups, rollouts = _rollouts(5)
    cfg = PGLossConfig(mode="seq_mean", policy_loss="ppo", clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH,
                       rollout_correction=kind, rollout_correction_max=cap, rollout_correction_min=floor,
                       report_entropy=False)
    plan = plan_step(rollouts, cfg, PlanConfig(dp_size=2, num_microbatches=2))
    ref_w, ref_n, ref_masked, ref_truncated = _reference_correction(seqs, kind, cap, floor)
    got_w, got_n, got_d = {}, {}, {}
    stats = plan.correction_stats
    masked, valid = stats["correction_masked"]
    truncated, valid_too = stats["correction_truncated"]
    weight_sum, weight_count = stats["correction_weight"]
    assert valid_too == valid
    for rank in plan.microbatches:
        for mb in rank:
            for k, seq_id in enumerate(mb.sequence_ids):
                start, end = int(mb.cu_seqlens_padded[k]), int(mb.cu_seqlens[k + 1] - mb.cu_seqlens[k])
                prompt = len(rollouts[seq_id].prompt_ids)
                span = slice(start + prompt - 1, start + end - 1)  # positions scoring the response
                got_w[seq_id] = mb.correction_weights[span].tolist()
                got_n[seq_id] = mb.numerator_mask[span].int().tolist()
                got_d[seq_id] = mb.denominator_mask[span].int().tolist()
    for i, seq in enumerate(seqs):
        assert got_d[i] == [t["d"] for t in seq]
        assert got_n[i] == ref_n[i], (kind, i)
        for j, t in enumerate(seq):
            if t["d"]:
                assert got_w[i][j] == pytest.approx(ref_w[i][j], rel=1e-6), (kind, i, j)
    assert valid == sum(t["d"] for s in seqs for t in s)
    assert (masked, truncated) == (ref_masked, ref_truncated)
    assert (ref_masked if kind.endswith("mask") else ref_truncated) > 0  # the case is exercised
    ref_weight = [ref_w[i][j] for i, s in enumerate(seqs) for j, t in enumerate(s) if ref_n[i][j]]
    assert weight_count == len(ref_weight) and weight_sum == pytest.approx(sum(ref_weight), rel=1e-5)
    # the objective from the planned microbatches equals the reference with the correction
    logps = [torch.tensor([t["logp"] for t in seq], dtype=torch.float64) for seq in seqs]
    ref = _reference_objective(seqs, groups, "seq_mean", "ppo", logps, pg_weights=ref_w, numerators=ref_n)
    total_loss, total_count = 0.0, 0
    for rank in plan.microbatches:
        for mb in rank:
            logp = torch.zeros(mb.num_tokens)
            for k, seq_id in enumerate(mb.sequence_ids):
                start, end = int(mb.cu_seqlens_padded[k]), int(mb.cu_seqlens[k + 1] - mb.cu_seqlens[k])
                prompt = len(rollouts[seq_id].prompt_ids)
                logp[start + prompt - 1:start + end - 1] = torch.tensor([t["logp"] for t in seqs[seq_id]])
            loss, count, report = pg_loss_sum(logp, mb, plan.totals, cfg)
            total_loss += float(loss)
            total_count += int(count)
    assert total_loss / total_count == pytest.approx(float(ref), rel=1e-5)


def test_correction_weights_leave_kl_and_entropy_alone():
    """The weights multiply the PG term only: with advantages 0 (PG term 0) the objective is the
    KL + entropy token means, whatever the correction does."""
    seqs, groups, rollouts = _rollouts(8)
    for r in rollouts:
        r.advantages = [0.0] * len(r.advantages)
        r.ref_logprobs = [lp - 0.1 for lp in r.old_logprobs]
    base = dict(mode="token_mean", kl_coef=0.5, report_entropy=False)
    plans = {kind: plan_step(rollouts, PGLossConfig(**base, rollout_correction=kind, rollout_correction_max=1.2),
                             PlanConfig(num_microbatches=1)) for kind in (None, "token_truncate")}
    values = {}
    for kind, plan in plans.items():
        mb = plan.microbatches[0][0]
        logp = mb.old_logprobs.clone()
        loss, count, _ = pg_loss_sum(logp, mb, plan.totals,
                                     PGLossConfig(**base, rollout_correction=kind, rollout_correction_max=1.2))
        values[kind] = float(loss) / int(count)
    assert values["token_truncate"] == pytest.approx(values[None], rel=1e-6) and values[None] > 0


@pytest.mark.parametrize("bad,needle", [
    (dict(policy_loss="grpo"), "policy_loss must be one of"),
    (dict(rollout_correction="token_clip"), "rollout_correction must be one of"),
    (dict(rollout_correction="token_mask", rollout_correction_max=1.0, rollout_correction_min=1.0), "C > c"),
    (dict(policy_loss="gspo", dual_clip=3.0), "dual_clip applies to the ppo"),
])
def test_bad_policy_configs_are_refused(bad, needle):
    with pytest.raises(ValueError, match=needle):
        PGLossConfig(**bad)


def test_a_correction_without_rollout_logprobs_is_refused_by_the_planner():
    _, _, rollouts = _rollouts(2)
    rollouts[3].rollout_logprobs = None
    with pytest.raises(ValueError, match="rollout_logprobs is missing"):
        plan_step(rollouts, PGLossConfig(rollout_correction="token_truncate"), PlanConfig())


def test_gspo_start_up_notes():
    """Warned once at start-up: gspo outside seq_mean (length-weighted), and advantages that vary
    within a sequence; nothing for ppo or for gspo under seq_mean on sequence-level advantages."""
    from megatron_pg_agg.data.planner import policy_loss_notes
    from megatron_pg_agg.data.rollouts import RolloutBatch

    _, _, rollouts = _rollouts(4)
    constant = [Rollout(**{**r.__dict__, "advantages": [r.advantages[0]] * len(r.advantages)}) for r in rollouts]
    steps = {0: RolloutBatch.from_rollouts(constant)}
    assert policy_loss_notes(steps, PGLossConfig(policy_loss="ppo", mode="token_mean")) == []
    assert policy_loss_notes(steps, PGLossConfig(policy_loss="gspo", mode="seq_mean")) == []
    (note,) = policy_loss_notes(steps, PGLossConfig(policy_loss="gspo", mode="prompt_mean"))
    assert "prompt_mean" in note and "seq_mean" in note
    varying = {0: RolloutBatch.from_rollouts(rollouts)}  # odd groups: per-token advantages
    expected = sum(1 for r in rollouts if len({a for a, m in zip(r.advantages, r.loss_mask) if m}) > 1)
    (note,) = policy_loss_notes(varying, PGLossConfig(policy_loss="gspo", mode="seq_mean"))
    assert f"vary within {expected} of {len(rollouts)} sequences" in note and expected > 0
