"""Property tests on random ragged steps against the slow float64 reference in tests/support/reference.py.

(a) local form over random whole-unit splits, (b) token form over random arbitrary partitions of
token indices: both equal the reference objective, and their gradients w.r.t. the loss equal the
reference's.
"""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pg_agg import aggregate, token_weights, weighted_sum
from tests.support.reference import MODE_KWARGS, random_step, reference_objective

MODES = list(MODE_KWARGS)
SEEDS = range(60)


def _reference(step, mode):
    loss = step.loss.detach().double().requires_grad_(True)
    value, weight = reference_objective(
        loss, step.numerator.tolist(), step.denominator.tolist(), step.lengths, step.group_sizes,
        mode, MODE_KWARGS[mode].get("divisor"),
    )
    value = value if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float64)
    grad = torch.autograd.grad(value, loss, allow_unused=True)[0] if value.requires_grad else None
    return value.detach(), weight, torch.zeros_like(loss) if grad is None else grad


def _kwargs(step, mode):
    kw = dict(MODE_KWARGS[mode])
    if mode == "prompt_mean":
        kw["group_sizes"] = step.group_sizes
    return kw


def _close(actual, expected, what):
    assert torch.allclose(actual.double(), expected, rtol=2e-6, atol=1e-7), (what, actual, expected)


def _whole_unit_cuts(rng, step, mode):
    """Random cut points at sequence boundaries (group boundaries for prompt_mean)."""
    if mode == "prompt_mean":
        bounds, acc = [0], 0
        for g in step.group_sizes:
            acc += g
            bounds.append(acc)
    else:
        bounds = list(range(len(step.lengths) + 1))
    inner = [b for b in bounds[1:-1] if rng.random() < 0.4]
    return [0, *inner, bounds[-1]]


@pytest.mark.parametrize("mode", MODES)
def test_local_form_over_whole_unit_splits_matches_reference(mode):
    for seed in SEEDS:
        rng = random.Random(seed)
        step = random_step(rng)
        ref_value, ref_weight, ref_grad = _reference(step, mode)
        loss = step.loss.clone().requires_grad_(True)
        cu = step.cu_seqlens.tolist()
        cuts = _whole_unit_cuts(rng, step, mode)
        total, weight = 0.0, 0
        for a, b in zip(cuts[:-1], cuts[1:]):  # sequences [a, b)
            part_cu = torch.tensor([c - cu[a] for c in cu[a:b + 1]], dtype=torch.int64)
            kw = dict(MODE_KWARGS[mode])
            if mode == "prompt_mean":
                # the groups lying in [a, b): cuts are group boundaries here
                sizes, acc = [], 0
                for g in step.group_sizes:
                    if a <= acc < b:
                        sizes.append(g)
                    acc += g
                kw["group_sizes"] = sizes
            mean, w = aggregate(loss[cu[a]:cu[b]], step.numerator[cu[a]:cu[b]], cu_seqlens=part_cu,
                                denominator_mask=step.denominator[cu[a]:cu[b]], mode=mode, **kw)
            total = total + mean * w
            weight += int(w)
        assert weight == ref_weight, (seed, mode)
        objective = total / max(weight, 1)
        objective = objective if isinstance(objective, torch.Tensor) else torch.tensor(objective)
        _close(objective, ref_value, (seed, mode, "value"))
        # the library's gradient, always: a detached result (no grad) is a bug, not a skip
        assert objective.requires_grad, (seed, mode, "the objective is not differentiable w.r.t. the loss")
        objective.backward()
        assert loss.grad is not None and torch.isfinite(loss.grad).all(), (seed, mode, loss.grad)
        _close(loss.grad, ref_grad, (seed, mode, "grad"))
        if not ref_weight:  # W = 0: the contract is exactly zero gradients
            assert torch.equal(loss.grad, torch.zeros_like(loss.grad)), (seed, mode, loss.grad)


def _check_token_form(step, mode, parts):
    ref_value, ref_weight, ref_grad = _reference(step, mode)
    weights = token_weights(step.numerator, cu_seqlens=step.cu_seqlens,
                            denominator_mask=step.denominator, mode=mode, **_kwargs(step, mode))
    loss = step.loss.clone().requires_grad_(True)
    sums, counts = [], []
    for idx in parts:
        s, c = weighted_sum(loss[idx], step.numerator[idx], weights[idx])
        assert s.dtype == torch.float32 and c.dtype == torch.int32
        sums.append(s)
        counts.append(c)
    total_weight = int(sum(counts))
    assert total_weight == ref_weight
    objective = torch.stack(sums).sum() / max(total_weight, 1)
    _close(objective, ref_value, (mode, "value"))
    objective.backward()
    assert torch.isfinite(loss.grad).all()
    _close(loss.grad, ref_grad, (mode, "grad"))


@pytest.mark.parametrize("mode", MODES)
def test_token_form_over_arbitrary_partitions_matches_reference(mode):
    for seed in SEEDS:
        rng = random.Random(1000 + seed)
        step = random_step(rng)
        total = step.loss.numel()
        order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
        cuts = sorted(rng.randint(0, total) for _ in range(rng.randint(0, 6)))
        parts = [order[a:b] for a, b in zip([0, *cuts], [*cuts, total])]  # empty parts allowed
        _check_token_form(step, mode, parts)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(MODES), pieces=st.integers(1, 9))
def test_token_form_hypothesis(seed, mode, pieces):
    rng = random.Random(seed)
    step = random_step(rng, max_groups=4, max_group=5, max_len=12)
    # each token assigned to a random part: parts interleave and cut sequences anywhere
    owner = torch.tensor([rng.randrange(pieces) for _ in range(step.loss.numel())], dtype=torch.long)
    parts = [torch.arange(step.loss.numel())[owner == p] for p in range(pieces)]
    _check_token_form(step, mode, parts)


@pytest.mark.parametrize("mode", MODES)
def test_padded_equals_packed(mode):
    for seed in range(20):
        rng = random.Random(500 + seed)
        step = random_step(rng, max_len=6)
        lengths, width = step.lengths, max(step.lengths + [1])
        rows = len(lengths)
        pad_loss = torch.full((rows, width), float("nan"))
        pad_num = torch.zeros(rows, width, dtype=torch.bool)
        pad_den = torch.zeros(rows, width, dtype=torch.bool)
        cu = step.cu_seqlens.tolist()
        for r, n in enumerate(lengths):
            pad_loss[r, :n] = step.loss[cu[r]:cu[r + 1]]
            pad_num[r, :n] = step.numerator[cu[r]:cu[r + 1]]
            pad_den[r, :n] = step.denominator[cu[r]:cu[r + 1]]
        kw = _kwargs(step, mode)
        packed = aggregate(step.loss, step.numerator, denominator_mask=step.denominator,
                           cu_seqlens=step.cu_seqlens, mode=mode, **kw)
        padded = aggregate(pad_loss, pad_num, denominator_mask=pad_den, mode=mode, **kw)
        assert int(packed[1]) == int(padded[1])
        assert torch.allclose(packed[0], padded[0], rtol=1e-6, atol=1e-7)
