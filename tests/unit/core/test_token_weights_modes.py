"""Every way a TokenWeights is built (index, slice, cat, padding, to, reshape) keeps its mode.

``weighted_sum`` skips the coefficients in token_mean (they are the mask there), so a construction
that dropped the mode (falling back to the default, token_mean) would silently turn seq_mean,
prompt_mean and constant into a token mean. Each construction is applied to the parts of a
partition of one ragged step; the parts' sums, combined, must give the independent float64
reference objective (tests/support/reference.py) in every mode. The last test shows the check
has teeth: the same weights with the mode dropped give another number in every mode but token_mean.
"""
from __future__ import annotations

import random

import pytest
import torch

from megatron_pg_agg.core.aggregation import TokenWeights, token_weights, weighted_sum
from tests.support.reference import random_step, reference_objective

MODES = ("token_mean", "seq_mean", "prompt_mean", "constant")


def _step():
    rng = random.Random(7)
    while True:  # a step whose modes all differ (several active sequences and groups)
        step = random_step(rng, max_groups=4, max_group=3, max_len=7, poison=False)
        if sum(1 for n in step.lengths if n) >= 5 and step.numerator.sum() >= 8:
            return step


def _weights(step, mode):
    return token_weights(step.numerator, mode=mode, cu_seqlens=step.cu_seqlens,
                         group_sizes=step.group_sizes, divisor=7.0 if mode == "constant" else None,
                         denominator_mask=step.denominator)


def _expected(step, mode):
    objective, _ = reference_objective(step.loss, step.numerator, step.denominator, step.lengths,
                                       step.group_sizes, mode, divisor=7.0 if mode == "constant" else None)
    return float(objective)


def _combined(pairs):
    total = sum(float(s) for s, _ in pairs)
    count = sum(int(c) for _, c in pairs)
    return total / count


def _constructions(step, w):
    """``{name: [(loss part, mask part, weights part)]}``: each a partition of the step's tokens."""
    loss, mask = step.loss, step.numerator
    T = loss.numel()
    half = T // 2
    even, odd = torch.arange(0, T, 2), torch.arange(1, T, 2)
    boolean = torch.arange(T) % 3 == 0
    pad = 5
    padded_w = TokenWeights.cat([w, TokenWeights(w.coef.new_zeros(pad), w.count.new_zeros(pad), w.mode)])
    rows = T - T % 2
    return {
        "index": [(loss[even], mask[even], w[even]), (loss[odd], mask[odd], w[odd])],
        "boolean index": [(loss[boolean], mask[boolean], w[boolean]), (loss[~boolean], mask[~boolean], w[~boolean])],
        "slice": [(loss[:half], mask[:half], w[:half]), (loss[half:], mask[half:], w[half:])],
        "cat": [(loss, mask, TokenWeights.cat([w[:half], w[half:]]))],
        "padding": [(torch.cat([loss, loss.new_zeros(pad)]), torch.cat([mask, mask.new_zeros(pad)]), padded_w)],
        "to": [(loss, mask, w.to("cpu"))],
        "reshape": [(loss[:rows].reshape(2, -1), mask[:rows].reshape(2, -1), w[:rows].reshape(2, -1)),
                    (loss[rows:], mask[rows:], w[rows:])],
    }


@pytest.mark.parametrize("mode", MODES)
def test_every_construction_keeps_the_mode_and_the_objective(mode):
    step = _step()
    w = _weights(step, mode)
    expected = _expected(step, mode)
    for name, parts in _constructions(step, w).items():
        assert all(part_w.mode == w.mode for _, _, part_w in parts), name
        got = _combined([weighted_sum(loss, mask, part_w) for loss, mask, part_w in parts])
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-7), (mode, name, got, expected)


@pytest.mark.parametrize("mode", MODES[1:])
def test_the_check_has_teeth_a_dropped_mode_changes_the_objective(mode):
    step = _step()
    w = _weights(step, mode)
    dropped = TokenWeights(w.coef, w.count)  # the default mode: token_mean
    got = _combined([weighted_sum(step.loss, step.numerator, dropped)])
    assert got != pytest.approx(_expected(step, mode), rel=1e-3), mode
