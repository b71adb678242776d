"""Every number a step reports, against float64 sums written here from the rollouts.

The step goes through the real planner (``plan_step`` with DP=2, two microbatches per rank and
TP=2 with sequence parallelism, so sequences are padded and split across bins), then
``pg_loss_sum`` on each microbatch; the microbatches' ``[sum, count]`` pairs are summed as
Megatron sums them and converted by ``report_values``, as both entries record them. The
reference knows nothing of the library: per token it evaluates the formulas of
docs/policy-losses.md in Python floats, per mode the contract's normaliser, and counts the
weight ``W`` from the masks and groups. Every mode x policy loss x KL estimator; every report key
(objective, pg_loss, clip_fraction, ratio, kl, entropy) and the step's weight and valid-token
count. A factor of 1.01 on any of them fails: tolerances are 1e-5 relative (float32 sums).

What each check would catch: a wrong normaliser or W (objective, pg_loss, weight); kl or entropy
averaged over the numerator or the wrong estimator (kl, entropy); the clip indicator of a policy
loss inverted or computed on the wrong ratio (clip_fraction); the reported ratio of gspo/gmpo
being the token ratio (ratio); a wrong N_i in the planner (gspo/gmpo ratio and objective);
padding tokens counted (valid_tokens, every mean).
"""
from __future__ import annotations

import random

import pytest
import torch

from megatron_pg_agg.core.losses import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PGLossConfig,
    SequenceStatistic,
    correction_values,
    pg_loss_sum,
    report_values,
)
from megatron_pg_agg.core.modes import MODES
from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.data.rollouts import Rollout
from tests.support.reference import LossNumbers, reference_record, reference_tokens

EPS_LOW, EPS_HIGH, DIVISOR, KL_COEF, ENTROPY_COEF = 0.2, 0.28, 12.0, 0.1, 0.01
VOCAB = 64


def _step(seed: int = 3):
    """Rollouts in ragged groups (sizes 3, 1, 2, 4) and, per response token, the current policy's
    log-prob and entropy. Group 1's response has no valid token; some tokens leave the numerator
    only; advantages are constant per sequence in even groups and vary per token in odd ones."""
    rng = random.Random(seed)
    rollouts, current = [], []
    for g, size in enumerate((3, 1, 2, 4)):
        for k in range(size):
            length = rng.randint(2, 9)
            seq_adv = rng.uniform(-1, 1)
            d = [0 if (g == 1 and k == 0) else int(rng.random() > 0.15) for _ in range(length)]
            n = [m if rng.random() > 0.2 else 0 for m in d]
            old = [-rng.uniform(0.5, 3.0) for _ in range(length)]
            shift = rng.uniform(-0.5, 0.5)  # per sequence: gspo's sequence ratio leaves the clip range
            logp = [o + shift + rng.uniform(-0.2, 0.2) for o in old]
            ref = [min(o + rng.uniform(-0.3, 0.3), -1e-3) for o in old]
            adv = [seq_adv if g % 2 == 0 else rng.uniform(-1, 1) for _ in range(length)]
            entropy = [rng.uniform(0.5, 4.0) for _ in range(length)]
            rollouts.append(Rollout(
                prompt_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))],
                response_ids=[rng.randrange(VOCAB) for _ in range(length)], loss_mask=d, advantages=adv,
                old_logprobs=old, ref_logprobs=ref, numerator_mask=n, group_id=f"g{g}"))
            current.append((logp, entropy))
    return rollouts, current


def _numbers(mode: str, policy: str, estimator: str = "k3", **extra) -> LossNumbers:
    return LossNumbers(mode=mode, policy=policy, estimator=estimator, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                       divisor=DIVISOR if mode == "constant" else None, kl_coef=KL_COEF,
                       entropy_coef=ENTROPY_COEF, **extra)


def _recorded(rollouts, current, cfg: PGLossConfig) -> dict:
    """The step as the entries record it: planned, each microbatch's pairs summed, converted."""
    plan = plan_step(rollouts, cfg, PlanConfig(dp_size=2, num_microbatches=2, tp_size=2, sequence_parallel=True))
    pairs: dict = {}
    for rank in plan.microbatches:
        for mb in rank:
            logp = torch.zeros(mb.num_tokens)
            entropy = torch.zeros(mb.num_tokens)
            for k, i in enumerate(mb.sequence_ids):
                start = int(mb.cu_seqlens_padded[k]) + len(rollouts[i].prompt_ids) - 1  # scores response 0
                length = len(rollouts[i].response_ids)
                logp[start:start + length] = torch.tensor(current[i][0])
                entropy[start:start + length] = torch.tensor(current[i][1])
            sequences = SequenceStatistic(mb.cu_seqlens_local, mb.seq_numerator_tokens, mb.num_tokens)
            _, _, report = pg_loss_sum(logp, mb, plan.totals, cfg, entropy=entropy, sequences=sequences)
            for name, pair in report.items():
                total = pairs.setdefault(name, [0.0, 0.0])
                total[0] += float(pair[0])
                total[1] += float(pair[1])
    return {**report_values(pairs, plan.totals.pg_weight), "weight": plan.totals.pg_weight,
            "valid_tokens": plan.totals.valid_tokens}


@pytest.mark.parametrize("policy", POLICY_LOSSES)
@pytest.mark.parametrize("mode", MODES)
def test_every_recorded_number_equals_the_float64_reference(mode, policy):
    rollouts, current = _step()
    for estimator in KL_ESTIMATORS:
        cfg = PGLossConfig(mode=mode, divisor=DIVISOR if mode == "constant" else None, policy_loss=policy,
                           clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, kl_coef=KL_COEF, kl_estimator=estimator,
                           entropy_coef=ENTROPY_COEF)
        got = _recorded(rollouts, current, cfg)
        want = reference_record(rollouts, current, _numbers(mode, policy, estimator))
        assert (got["weight"], got["valid_tokens"]) == (want["weight"], want["valid_tokens"])
        for key in ("objective", "pg_loss", "clip_fraction", "ratio", "kl", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (mode, policy, estimator, key)
        assert 0 < want["clip_fraction"] < 1  # the clip is active on some tokens, not all


def test_the_three_kl_estimators_differ_on_this_step():
    """The control for the estimator parametrisation: k1, k2 and k3 give different kl values here,
    so an estimator flag that were ignored (always k3) would fail the test above."""
    rollouts, current = _step()
    values = {est: reference_record(rollouts, current, _numbers("token_mean", "ppo", est))["kl"]
              for est in KL_ESTIMATORS}
    assert len({round(v, 6) for v in values.values()}) == 3, values


def test_ppo_dual_clip_caps_negative_advantages_as_the_reference():
    """ppo's dual clip: for A < 0 the token loss is min(pg, -A c), and a capped token counts as
    clipped. Catches the cap applied to positive advantages, or a capped token not reported."""
    rollouts, current = _step(seed=5)
    for r in rollouts:  # large ratios, so the cap binds on some tokens
        r.old_logprobs = [o - 1.5 * (j % 2) for j, o in enumerate(r.old_logprobs)]
    cap = 1.5
    cfg = PGLossConfig(mode="token_mean", clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, dual_clip=cap,
                       report_entropy=False)
    got = _recorded(rollouts, current, cfg)
    num = clipped = 0
    pg_sum = 0.0
    for r, (logp, _) in zip(rollouts, current):
        tokens = reference_tokens(r, logp, "ppo", EPS_LOW, EPS_HIGH)
        for (pg, _, was_clipped), a, m in zip(tokens, r.advantages, r.numerator_mask):
            dual = a < 0 and pg > -a * cap
            if m:
                num += 1
                clipped += was_clipped or dual
                pg_sum += -a * cap if dual else pg
    tokens_d = sum(sum(r.loss_mask) for r in rollouts)
    assert got["pg_loss"] == pytest.approx(pg_sum / tokens_d, rel=1e-5)
    assert got["clip_fraction"] == pytest.approx(clipped / num, rel=1e-9)
    plain = _recorded(rollouts, current, PGLossConfig(mode="token_mean", clip_eps_low=EPS_LOW,
                                                      clip_eps_high=EPS_HIGH, report_entropy=False))
    assert plain["pg_loss"] != pytest.approx(got["pg_loss"], rel=1e-3)  # the cap binds here


CORRECTIONS = {"token_truncate": (1.1, 0.0), "token_mask": (1.1, 0.9), "sequence_truncate": (1.02, 0.0),
               "sequence_mask": (1.05, 0.97)}


@pytest.mark.parametrize("kind", sorted(CORRECTIONS))
def test_every_rollout_correction_matches_the_float64_reference(kind):
    """Each correction, every mode x policy loss: the objective with the corrected PG terms
    (weights on pg_t, masked tokens out of the numerator and out of gspo/gmpo's N_i), the
    reported ratio and clip fraction over the corrected numerator, and the three correction
    counts, against float64 sums of docs/policy-losses.md. Catches a weight applied to KL or
    entropy, a truncation or mask bound off by one comparison, a sequence mean over the wrong
    tokens, and the counts taken over the wrong mask."""
    rollouts, current = _step()
    rng = random.Random(11)
    for r in rollouts:  # the engine's log-probs differ by up to ~0.2 per token, and by sequence
        bias = rng.uniform(-0.08, 0.08)
        r.rollout_logprobs = [o - bias - rng.uniform(-0.1, 0.1) for o in r.old_logprobs]
    cap, floor = CORRECTIONS[kind]
    for mode in MODES:
        for policy in POLICY_LOSSES:
            cfg = PGLossConfig(mode=mode, divisor=DIVISOR if mode == "constant" else None, policy_loss=policy,
                               clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, kl_coef=KL_COEF,
                               entropy_coef=ENTROPY_COEF, rollout_correction=kind, rollout_correction_max=cap,
                               rollout_correction_min=floor)
            plan = plan_step(rollouts, cfg, PlanConfig(dp_size=2, num_microbatches=2))
            got = {**_recorded(rollouts, current, cfg), **correction_values(plan.correction_stats)}
            want = reference_record(rollouts, current, _numbers(mode, policy, correction=(kind, cap, floor)))
            assert (got["weight"], got["valid_tokens"]) == (want["weight"], want["valid_tokens"])
            for key in ("objective", "pg_loss", "clip_fraction", "ratio", "kl", "entropy", "correction_masked",
                        "correction_truncated", "correction_weight"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (kind, mode, policy, key)
    # the case is exercised: the correction changes something on this step
    assert want["correction_masked" if kind.endswith("mask") else "correction_truncated"] > 0, want
