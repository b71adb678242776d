"""The audit's measurement, host-independent: every split a host's config allows, through the host's
stock loss and through the plug-in line, on one synthetic batch.

A host module (``megatron_pg_agg.audit.hosts.<host>``) gives, for its loaded config, the splits and two
functions ``stock(config, batch, split, logprobs)`` and ``plugin(...)`` that run the host's own loss
code over the split and return ``(J, steps)``: the collection's objective as a scalar tensor built from
the leaves ``logprobs`` (one per row) and the row indices of each optimizer step: ``(J_steps, steps)``,
one objective per optimizer step of the collection (all at the same weights: the first pass), since
which rows share a step is part of what a split changes. Per step the weight a token gets is

    w_st = dJ_s / d logp_t        (what step s back-propagates into token t)

Per split the audit reports J (the steps' mean), its relative difference to the first split (the
configured one) ``max_s |J_s - J0_s| / max(max_s |J0_s|, 0.1)``, and the relative L2 difference of the weights
``||w - w0|| / ||w0||`` over every step and token; the spread is the largest of both over the splits.
The splits of one config keep the number of steps (the global batch): a step is the unit the
objective is defined on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_pg_agg.audit.batch import AuditBatch
from megatron_pg_agg.integrations.step_weights import cut_groups

__all__ = ["Split", "SplitRefused", "SplitResult", "evaluate", "length_weight_ratio", "measure_splits",
           "row_weights", "spread"]


class SplitRefused(ValueError):
    """The host's own code refuses this split of the config (its message): the split is left out."""


@dataclass(frozen=True)
class Split:
    """One way the host may cut the collection: its settings, as the host's keys name them."""

    name: str
    """How the report names it (``micro-batch 2, DP 2``)."""
    settings: dict = field(default_factory=dict)
    """The host's values for this split (host-specific keys)."""


@dataclass(frozen=True)
class SplitResult:
    """What one split gives."""

    split: Split
    objective: float
    """The mean of the steps' J."""
    steps: torch.Tensor
    """float64 [steps]: each optimizer step's J."""
    weights: torch.Tensor
    """float64 [steps, every token row after row]: ``dJ_s / d logp_t``."""
    cut: list
    """The prompt groups this split's optimizer steps cut (``cut_groups``' lines)."""
    members: tuple = ()
    """The rows of each optimizer step (sorted), to tell which splits keep the configured membership."""
    relative: float = 0.0
    """``|J - J_0| / |J_0|`` against the first split."""
    gradient: float = 0.0
    """``||w - w_0|| / ||w_0||`` against the first split."""


def evaluate(fn: Callable, batch: AuditBatch) -> tuple:
    """``(J per step, w per step, steps)`` of ``fn(leaves) -> (J per step, steps)`` with fresh leaves of
    the batch's log-probs."""
    leaves = [lp.detach().clone().requires_grad_(True) for lp in batch.logprobs]
    values, steps = fn(leaves)
    rows = []
    for s, value in enumerate(values):
        grads = torch.autograd.grad(value, leaves, allow_unused=True, retain_graph=s + 1 < len(values))
        rows.append(torch.cat([torch.zeros(lp.numel(), dtype=torch.float64) if g is None else g.double()
                               for g, lp in zip(grads, leaves)]))
    return torch.stack([v.detach().double() for v in values]), torch.stack(rows), steps


OBJECTIVE_FLOOR = 0.1
"""Objectives are compared against ``max(max_s |J0_s|, 0.1)``: J averages per-token terms of order 1 (``|A| r``,
advantages normalised per group), which cancel to objectives near 0; float32 rounding of such an average (the
hosts' losses run in float32) is ~1e-8 absolute, 1e-7 of this floor (as tests/distributed/test_megatron_rl.py's
TERM_SIZE). The token weights' difference has no floor."""


def _ratio(a: torch.Tensor, b: torch.Tensor, norm: Callable, floor: float = 1e-30) -> float:
    if a.shape != b.shape:
        raise ValueError(f"splits with {a.shape[0]} and {b.shape[0]} optimizer steps cannot be compared")
    return float(norm(a - b)) / max(float(norm(b)), floor)


def measure_splits(run: Callable, config, batch: AuditBatch, splits: list, refused: Optional[dict] = None) -> list:
    """Each split of ``splits`` through ``run(config, batch, split, leaves)``, compared with the first; a
    split the host refuses (:class:`SplitRefused`) goes into ``refused`` (name: message) instead."""
    results = []
    for split in splits:
        try:
            values, weights, steps = evaluate(lambda leaves, s=split: run(config, batch, s, leaves), batch)
        except SplitRefused as error:
            if refused is None:
                raise
            refused[split.name] = str(error)
            continue
        cut = cut_groups(steps, batch.group_ids, batch.rows) if steps is not None else []
        members = tuple(tuple(sorted(step)) for step in steps or ())
        result = SplitResult(split, float(values.mean()), values, weights, cut, members)
        if results:
            base = results[0]
            result = SplitResult(split, result.objective, values, weights, cut, members,
                                 _ratio(values, base.steps, lambda x: x.abs().max(), OBJECTIVE_FLOOR),
                                 _ratio(weights, base.weights, torch.linalg.norm))
        results.append(result)
    return results


def spread(results: list) -> float:
    """The largest relative difference, objective or weights, over the splits."""
    return max([max(r.relative, r.gradient) for r in results] or [0.0])


def row_weights(result: SplitResult, batch: AuditBatch) -> dict:
    """``{row: the mean weight of its trained tokens}``, a token's weight being ``|w_t| / (|A| r_t)`` with
    ``r_t = exp(logp_t - old_t)``: PPO's ``dJ/dlogp_t = -A r_t c_t`` on an unclipped token, so this is the
    aggregation's coefficient ``c_t`` (KL terms aside). Rows with no trained token (``w_t = 0``: masked,
    or PPO's clip) or a zero advantage are left out."""
    per_row, start = {}, 0
    total = result.weights.sum(0)
    for i, n in enumerate(batch.lengths):
        w = total[start:start + n].abs()
        start += n
        ratio = (batch.logprobs[i] - batch.old_logprobs[i]).double().exp()
        trained = w > 0
        if bool(trained.any()) and float(batch.advantages[i].abs()) > 1e-6:
            per_row[i] = float((w[trained] / ratio[trained]).mean()) / float(batch.advantages[i].abs())
    return per_row


def length_weight_ratio(result: SplitResult, batch: AuditBatch) -> Optional[float]:
    """The weight a token gets in the longest trained response against the shortest one
    (:func:`row_weights`, by valid tokens): 1 for a token mean, ``short / long`` for a mean of sequence
    means. None when fewer than two rows are trained."""
    per_row = row_weights(result, batch)
    if len(per_row) < 2:
        return None
    longest = max(per_row, key=lambda i: (int(batch.masks[i].sum()), -i))
    shortest = min(per_row, key=lambda i: (int(batch.masks[i].sum()), i))
    return per_row[longest] / per_row[shortest]
