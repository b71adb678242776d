"""An independent, slow reference of the aggregation contract, and random ragged steps.

Written from the contract (README.md, "The contract") with Python loops in float64, sharing no code with
the library, so a bug in the library's vectorised index arithmetic cannot hide here.
"""
from __future__ import annotations

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
