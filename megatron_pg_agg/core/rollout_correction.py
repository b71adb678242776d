"""The rollout-engine correction: importance weights, truncation and masking against the engine's log-probs.

The rollout engine (vLLM, SGLang) samples with log-probs ``rollout_t`` that differ from the trainer's
behaviour policy ``old_t``. With ``delta_t = old_t - rollout_t`` (the mean over a sequence's valid
tokens for the sequence kinds), ``PGLossConfig.rollout_correction`` is one of:

* ``token_truncate`` (TIS): the PG term of token t weighted by ``w_t = min(exp(delta_t), C)``;
* ``token_mask``: tokens with ``exp(delta_t)`` outside ``[c, C]`` leave the numerator;
* ``sequence_truncate``: every token of sequence i weighted by ``w_i = min(exp(mean_i delta), C)``;
* ``sequence_mask``: a whole sequence leaves the numerator when ``exp(mean_i delta)`` is outside ``[c, C]``,

with ``C = rollout_correction_max`` and ``c = rollout_correction_min``. Masked tokens keep their place
in the denominator (the filtered-numerator rule of :mod:`megatron_pg_agg.core.aggregation`), and the
correction never touches the KL and entropy terms (:mod:`megatron_pg_agg.core.losses`). Host tensors,
once per step: the planner applies it to a step's rollouts, the verl plug-in to a mini-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .losses import PGLossConfig
from .segments import exclusive_cumsum, segment_ids


@dataclass(frozen=True)
class RolloutCorrection:
    """A step's rollout-engine correction on the response tokens (rollout order), host tensors."""

    numerator_mask: torch.Tensor
    """bool: the numerator after masking (tokens outside [c, C] leave it; the denominator stays)."""
    weights: torch.Tensor
    """float32: the weight of each token's PG term (truncated importance weight, else 1)."""
    masked: torch.Tensor
    """bool: valid tokens the correction removed from the numerator."""
    truncated: torch.Tensor
    """bool: valid tokens whose weight was capped at C."""


def rollout_correction(loss_mask: torch.Tensor, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                       response_lengths: torch.Tensor, loss_cfg: PGLossConfig, *,
                       numerator_mask: Optional[torch.Tensor] = None) -> Optional[RolloutCorrection]:
    """The correction ``loss_cfg.rollout_correction`` asks for (module docstring; None when off).

    Per response token, sequences laid end to end: ``loss_mask`` (bool, the valid tokens: the
    denominator), ``old_logprobs`` and ``rollout_logprobs`` (read at valid tokens only), and
    ``numerator_mask`` (bool, within ``loss_mask``; None: the loss mask); ``response_lengths``
    (int64, one per sequence) are the sequence boundaries the sequence kinds average over."""
    kind = loss_cfg.rollout_correction
    if kind is None:
        return None
    valid = loss_mask
    numerator = valid if numerator_mask is None else numerator_mask
    delta = torch.where(valid, old_logprobs.double() - rollout_logprobs.double(), 0.0)
    if kind.startswith("sequence"):
        r_start = exclusive_cumsum(response_lengths)
        owner = segment_ids(r_start, int(r_start[-1]))
        n = response_lengths.numel()
        sums = torch.zeros(n, dtype=torch.float64).index_add_(0, owner, delta)
        counts = torch.zeros(n, dtype=torch.float64).index_add_(0, owner, valid.double())
        delta = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0)[owner]
    ratio = torch.exp(delta)
    cap, floor = loss_cfg.rollout_correction_max, loss_cfg.rollout_correction_min
    no = torch.zeros_like(valid)
    if kind.endswith("truncate"):
        truncated = valid & (ratio > cap)
        weights = torch.where(valid, ratio.clamp(max=cap), 1.0).float()
        return RolloutCorrection(numerator, weights, no, truncated)
    keep = (ratio >= floor) & (ratio <= cap)
    return RolloutCorrection(numerator & keep, torch.ones_like(ratio, dtype=torch.float32), valid & ~keep, no)


def correction_stats(loss_mask: torch.Tensor, correction: RolloutCorrection) -> dict:
    """The step's correction counts as host ``{name: (sum, count)}``: tokens masked and truncated
    over the valid tokens (``loss_mask``), and the sum of the weights over the (corrected)
    numerator tokens (the pairs of ``losses.CORRECTION_REPORT_KEYS``)."""
    valid = float(loss_mask.sum())
    numerator = correction.numerator_mask
    return {
        "correction_masked": (float(correction.masked.sum()), valid),
        "correction_truncated": (float(correction.truncated.sum()), valid),
        "correction_weight": (float(torch.where(numerator, correction.weights, 0.0).sum()), float(numerator.sum())),
    }
