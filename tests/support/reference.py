"""An independent, slow reference of the aggregation contract, and random ragged steps.

Written from the contract (README.md, "The contract") with Python loops in float64, sharing no code with
the library, so a bug in the library's vectorised index arithmetic cannot hide here.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch


@dataclass
class Step:
    """One optimizer step of packed rollouts."""

    loss: torch.Tensor  # float32 [T]; NaN/inf at positions outside the numerator mask
    numerator: torch.Tensor  # bool [T]
    denominator: torch.Tensor  # bool [T]
    cu_seqlens: torch.Tensor  # int32 [S+1]
    group_sizes: list[int]

    @property
    def lengths(self) -> list[int]:
        cu = self.cu_seqlens.tolist()
        return [b - a for a, b in zip(cu[:-1], cu[1:])]


def random_step(rng: random.Random, *, max_groups=5, max_group=4, max_len=9, poison=True) -> Step:
    """A ragged step: groups of 1..max_group sequences, some empty or fully masked sequences,
    filtered numerator tokens, and NaN/inf written at every position outside the numerator."""
    group_sizes = [rng.randint(1, max_group) for _ in range(rng.randint(1, max_groups))]
    lengths = [rng.randint(0, max_len) for _ in range(sum(group_sizes))]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    total = cu[-1]
    den, num = [], []
    for n in lengths:
        kind = rng.random()
        for _ in range(n):
            d = kind > 0.15 and rng.random() > 0.25  # ~15% of sequences have no valid token
            den.append(d)
            num.append(d and rng.random() > 0.2)  # filtered tokens leave the numerator only
    loss = torch.tensor([rng.uniform(-3, 3) for _ in range(total)], dtype=torch.float32)
    numerator = torch.tensor(num, dtype=torch.bool)
    if poison and total:
        bad = torch.tensor([rng.choice([float("nan"), float("inf"), -float("inf")]) for _ in range(total)])
        loss = torch.where(numerator, loss, bad)
    return Step(loss, numerator, torch.tensor(den, dtype=torch.bool),
                torch.tensor(cu, dtype=torch.int32), group_sizes)


def reference_objective(loss, numerator, denominator, lengths, group_sizes, mode, divisor=None):
    """J and W of the step, with float64 loops. ``loss`` may require grad (float64 autograd)."""
    loss = loss.double()
    zero = loss.new_zeros(())
    seqs, start = [], 0
    for n in lengths:
        idx = list(range(start, start + n))
        start += n
        num = zero + sum((loss[t] for t in idx if numerator[t]), zero)
        den = sum(int(denominator[t]) for t in idx)
        seqs.append((num, den))
    if mode == "token_mean":
        den = sum(d for _, d in seqs)
        total = sum((s for s, _ in seqs), zero)
        return (total / den if den else zero), den
    if mode in ("seq_mean", "constant"):
        active = [(s, d) for s, d in seqs if d > 0]
        if not active:
            return zero, 0
        if mode == "seq_mean":
            return sum((s / d for s, d in active), zero) / len(active), len(active)
        return sum((s for s, _ in active), zero) / (len(active) * divisor), len(active)
    assert mode == "prompt_mean"
    groups, i = [], 0
    for g in group_sizes:
        members = seqs[i:i + g]
        i += g
        groups.append((sum((s for s, _ in members), zero), sum(d for _, d in members)))
    active = [(s, d) for s, d in groups if d > 0]
    if not active:
        return zero, 0
    return sum((s / d for s, d in active), zero) / len(active), len(active)


MODE_KWARGS = {
    "token_mean": {},
    "seq_mean": {},
    "prompt_mean": {},  # group_sizes added per step
    "constant": {"divisor": 7.0},
}


# ----------------------------------------------------------------------------- reported numbers


@dataclass(frozen=True)
class LossNumbers:
    """The numbers of a loss configuration the reference reads (written here, not the library's
    config): mode and divisor, policy loss and its clip range, KL estimator and the coefficients,
    and an optional rollout correction ``(kind, C, c)``."""

    mode: str = "token_mean"
    policy: str = "ppo"
    estimator: str = "k3"
    eps_low: float = 0.2
    eps_high: float = 0.2
    divisor: float | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    correction: tuple | None = None


def reference_tokens(r, logp: list, policy: str, eps_low: float, eps_high: float, numerator=None) -> list:
    """Per response token ``(pg, ratio, clipped)`` by the formulas of docs/policy-losses.md, from
    the current log-probs ``logp``; ``numerator`` (default ``r.numerator_mask`` within
    ``r.loss_mask``) holds the tokens of the sequence statistics N_i of gspo/gmpo."""
    x = [lp - o for lp, o in zip(logp, r.old_logprobs)]
    num = numerator if numerator is not None else _numerator(r)
    n_i = sum(num)
    out = []
    if policy == "gspo":
        s_i = math.exp(sum(v for v, m in zip(x, num) if m) / n_i) if n_i else 1.0
    if policy == "gmpo":
        def m_of(j):
            a = 1.0 if r.advantages[j] >= 0 else -1.0
            return a * min(a * x[j], a * min(max(x[j], -eps_low), eps_high))
        ms = [m_of(j) for j in range(len(x))]
        mean_m = sum(v for v, m in zip(ms, num) if m) / n_i if n_i else 0.0
    for j, a in enumerate(r.advantages):
        if policy in ("ppo", "gspo"):
            ratio = math.exp(x[j]) if policy == "ppo" else s_i
            clipped = -a * min(max(ratio, 1 - eps_low), 1 + eps_high)
            out.append((max(-a * ratio, clipped), ratio, clipped > -a * ratio))
        elif policy == "gmpo":
            out.append((-a * math.exp(mean_m), math.exp(mean_m), ms[j] != x[j]))
        else:  # cispo: -sg(clip(r)) A logp, whose value is -clip(r) A logp
            ratio = math.exp(x[j])
            w = min(max(ratio, 1 - eps_low), 1 + eps_high)
            out.append((-w * a * logp[j], ratio, w != ratio))
    return out


def _numerator(r) -> list:
    d = [bool(v) for v in r.loss_mask]
    return d if r.numerator_mask is None else [m and bool(n) for m, n in zip(d, r.numerator_mask)]


def reference_kl(logp: float, ref: float, estimator: str) -> float:
    log_ratio = logp - ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    return math.exp(-log_ratio) + log_ratio - 1.0


def reference_correction(r, kind: str, cap: float, floor: float) -> tuple:
    """One rollout's correction ``(weights, numerator, masked, truncated)`` per response token, from
    ``delta = old - rollout`` log-probs (docs/policy-losses.md; sequence kinds use the mean delta
    over the sequence's valid tokens)."""
    d = [bool(v) for v in r.loss_mask]
    delta = [o - e for o, e in zip(r.old_logprobs, r.rollout_logprobs)]
    if kind.startswith("sequence"):
        count = sum(d)
        mean = sum(v for v, m in zip(delta, d) if m) / count if count else 0.0
        delta = [mean] * len(delta)
    ratios = [math.exp(v) for v in delta]
    numerator = _numerator(r)
    if kind.endswith("truncate"):
        weights = [min(q, cap) if m else 1.0 for q, m in zip(ratios, d)]
        return weights, numerator, [False] * len(d), [m and q > cap for q, m in zip(ratios, d)]
    keep = [floor <= q <= cap for q in ratios]
    return ([1.0] * len(d), [n and k for n, k in zip(numerator, keep)],
            [m and not k for m, k in zip(d, keep)], [False] * len(d))


def reference_record(rollouts, current, numbers: LossNumbers) -> dict:
    """Every number a step's record holds, in float64 from the rollouts and, per rollout, the
    current policy's ``(logp, entropy)`` of each response token: objective, pg_loss, clip_fraction,
    ratio, kl, entropy, weight, valid_tokens and (with a correction) correction_masked,
    correction_truncated and correction_weight."""
    seq_num, seq_den, groups = [], [], {}
    clipped = ratio_sum = numerator_tokens = 0
    kl_sum = entropy_sum = 0.0
    masked = truncated = weight_sum = 0.0
    for r, (logp, entropy) in zip(rollouts, current):
        weights, numerator = [1.0] * len(r.loss_mask), _numerator(r)
        if numbers.correction is not None:
            weights, numerator, m, t = reference_correction(r, *numbers.correction)
            masked += sum(m)
            truncated += sum(t)
            weight_sum += sum(w for w, n in zip(weights, numerator) if n)
        tokens = reference_tokens(r, logp, numbers.policy, numbers.eps_low, numbers.eps_high, numerator)
        seq_num.append(sum(w * pg for (pg, _, _), w, n in zip(tokens, weights, numerator) if n))
        seq_den.append(sum(int(bool(v)) for v in r.loss_mask))
        for (_, ratio, was_clipped), n in zip(tokens, numerator):
            if n:
                numerator_tokens += 1
                ratio_sum += ratio
                clipped += was_clipped
        for j, d in enumerate(r.loss_mask):
            if d:
                kl_sum += reference_kl(logp[j], r.ref_logprobs[j], numbers.estimator)
                entropy_sum += entropy[j]
        num, den = groups.get(r.group_id, (0.0, 0))
        groups[r.group_id] = (num + seq_num[-1], den + seq_den[-1])
    tokens_d = sum(seq_den)
    active = [i for i, d in enumerate(seq_den) if d > 0]
    live = [num / den for num, den in groups.values() if den > 0]
    pg_loss, weight = {
        "token_mean": lambda: (sum(seq_num) / tokens_d, tokens_d),
        "seq_mean": lambda: (sum(seq_num[i] / seq_den[i] for i in active) / len(active), len(active)),
        "prompt_mean": lambda: (sum(live) / len(live), len(live)),
        "constant": lambda: (sum(seq_num) / (len(active) * numbers.divisor), len(active)),
    }[numbers.mode]()
    kl, entropy = kl_sum / tokens_d, entropy_sum / tokens_d
    record = {"objective": pg_loss + numbers.kl_coef * kl - numbers.entropy_coef * entropy, "pg_loss": pg_loss,
              "clip_fraction": clipped / numerator_tokens, "ratio": ratio_sum / numerator_tokens, "kl": kl,
              "entropy": entropy, "weight": weight, "valid_tokens": tokens_d}
    if numbers.correction is not None:
        record.update(correction_masked=masked / tokens_d, correction_truncated=truncated / tokens_d,
                      correction_weight=weight_sum / numerator_tokens)
    return record


def reference_weight(rollouts, mode: str) -> tuple:
    """``(W, valid tokens)`` of a step from its masks and groups alone: valid tokens
    (token_mean), sequences with a valid token (seq_mean, constant), groups with one
    (prompt_mean)."""
    valid = [sum(int(bool(v)) for v in r.loss_mask) for r in rollouts]
    groups = {}
    for r, d in zip(rollouts, valid):
        groups[r.group_id] = groups.get(r.group_id, 0) + d
    weight = {"token_mean": sum(valid), "seq_mean": sum(d > 0 for d in valid),
              "constant": sum(d > 0 for d in valid), "prompt_mean": sum(d > 0 for d in groups.values())}[mode]
    return weight, sum(valid)
