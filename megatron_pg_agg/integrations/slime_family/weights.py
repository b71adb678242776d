"""The per-sample denominators that make slime's (and miles') own loss exact in every mode (host side, no host import).

slime (THUDM/slime) and miles (radixark/miles, derived from slime), Megatron backend,
``--calculate-per-token-loss`` off, back-propagate for one optimizer step (the host's
``build_dp_schedule`` step: ``--global-batch-size`` rollouts in order)

    J_host = (1 / R) * sum_i sum_t m_it l_it / clamp_min(D_i, 1)

whatever the micro-batches, DP ranks and CP shards (their ``get_sum_of_sample_mean`` with
``D_i = rollout_mask_sums[i]``, then ``loss * num_mb / R * dp_cp`` undone by megatron-core's
``1 / num_mb`` and DDP's average). ``R`` is the step's divisor: slime's ``--global-batch-size``
(``gbs``), miles' per-step ``num_rollouts`` (``--global-batch-size``, or the rollouts of a partial
last step under ``--allow-partial-train-step``). ``m_it`` is the loss mask the host hands the loss: the numerator
mask ``n`` of the project's contract (:mod:`megatron_pg_agg.core.aggregation`). The project's
objective for the step is ``J = (1 / W) sum_t c_t n_t l_t`` with ``c_t`` and ``W`` from
:func:`~megatron_pg_agg.core.aggregation.token_weights` (through
:func:`~megatron_pg_agg.integrations.step_weights.dp_step_weights`); ``c_t`` is one value ``c_i`` over a
sample's tokens in every mode. So

    D_i = W / (R * c_i)

makes ``J_host = J`` exactly, as long as every ``D_i`` of a sample with a numerator token is at
least 1 (the clamp). Per mode (``N`` valid tokens of the step, ``S`` active sequences, ``P`` active
prompt groups, ``D_s`` / ``T_g`` the valid tokens of a sequence / group): token_mean ``N / R``,
seq_mean ``S * D_s / R``, prompt_mean ``P * T_g / R``, constant ``S * L / R``. A sample with
no numerator token adds nothing whatever its ``D_i``; it gets 1. A ``D_i < 1`` is refused
(the host's error class, naming the samples), never clamped: the host would silently train another
objective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import torch

from megatron_pg_agg.core.modes import CONSTANT, PROMPT_MEAN
from megatron_pg_agg.core.segments import exclusive_cumsum
from megatron_pg_agg.integrations.objective import HostObjective
from megatron_pg_agg.integrations.step_weights import cut_groups, dp_step_weights

__all__ = ["CLAMP_SLACK", "HostTerms", "SlimeFamilyConfigError", "step_denominators"]

CLAMP_SLACK = 1e-6
"""A ``D_i`` within this relative distance below 1 is accepted (float32 rounding of an exact 1:
the clamp then moves the sample's weight by less than that)."""

_FORMULA = {"token_mean": "N/{R} (valid tokens of the step / {size})",
            "seq_mean": "S*D_s/{R} (active samples of the step x the sample's valid tokens / {size})",
            "prompt_mean": "P*T_g/{R} (active groups of the step x the group's valid tokens / {size})",
            "constant": "S*L/{R} (active samples of the step x pg_agg_divisor / {size})"}


class SlimeFamilyConfigError(ValueError):
    """A configuration or rollout a slime-family plug-in refuses (names the flags or the samples); each
    host subclasses it (``SlimeConfigError``, ``MilesConfigError``)."""


@dataclass(frozen=True)
class HostTerms:
    """How a slime-family host is named in the refusals."""

    name: str
    """The host's name (``slime``, ``miles``)."""
    error: type
    """The exception class raised (a :class:`SlimeFamilyConfigError`)."""
    step_symbol: str
    """The symbol of the step divisor R in the formulas (``gbs``, ``R``)."""
    step_size: str
    """What R is, in the host's flags (``--global-batch-size``)."""

    @property
    def owner(self) -> str:
        """The host's name as an owner (``slime's``, ``miles'``)."""
        return self.name + ("'" if self.name.endswith("s") else "'s")


def _packed(masks: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bool [tokens] of the masks end to end, int64 [rows] lengths)``."""
    lengths = torch.tensor([len(m) for m in masks], dtype=torch.int64)
    flat = [int(v) for m in masks for v in m]
    return torch.tensor(flat, dtype=torch.bool), lengths


def step_denominators(denominator_masks: Sequence[Sequence[int]], numerator_masks: Sequence[Sequence[int]],
                      steps: Sequence[Sequence[int]], group_ids: Optional[Sequence[Hashable]], *,
                      step_sizes: Sequence[int], objective: HostObjective, host: HostTerms,
                      names: Optional[Sequence[str]] = None) -> list[float]:
    """``D_i`` for every sample (module docstring), float64 host values.

    ``denominator_masks[i]`` / ``numerator_masks[i]``: sample i's response mask before / after
    the host's filtering (``n <= d``); ``steps``: the sample indices of each optimizer step, in the
    host's order (samples in no step are never trained: they get 1); ``step_sizes``: each step's R;
    ``group_ids``: the prompt group of each sample (prompt_mean; a group must lie in one step);
    ``names``: how errors name a sample. Raises ``host.error`` naming every sample whose ``D_i``
    would be below 1, and every prompt group cut across steps."""
    if len(step_sizes) != len(steps):
        raise ValueError(f"{len(step_sizes)} step sizes for {len(steps)} steps")
    count = len(denominator_masks)
    if len(numerator_masks) != count:
        raise ValueError(f"{len(numerator_masks)} numerator masks for {count} samples")
    names = list(names) if names is not None else [f"sample {i}" for i in range(count)]
    for i, (d, n) in enumerate(zip(denominator_masks, numerator_masks)):
        if len(d) != len(n) or any(int(a) and not int(b) for a, b in zip(n, d)):
            raise ValueError(f"{names[i]}: the numerator mask must have the denominator mask's length and lie "
                             "inside it")
    grouped = objective.mode == PROMPT_MEAN
    if grouped:
        if group_ids is None or any(g is None for g in group_ids):
            missing = [names[i] for i in range(count) if group_ids is None or group_ids[i] is None]
            raise host.error(f"prompt_mean needs each sample's prompt group ({host.owner} Sample.group_index); "
                             f"it is None for: {', '.join(missing[:20])}")
        cut = cut_groups(steps, group_ids, count, remainder=f"the remainder {host.name} drops")
        if cut:
            raise host.error(
                f"prompt_mean needs every prompt group inside one optimizer step, but {host.owner} step grouping "
                "(--global-batch-size rollouts in order) cuts " + "; ".join(cut[:20])
                + ": make --global-batch-size a multiple of --n-samples-per-prompt (and keep a group's "
                "samples together)")
    out = [1.0] * count
    low = []
    for s, members in enumerate(steps):
        members = list(members)
        den, lengths = _packed([denominator_masks[i] for i in members])
        num, _ = _packed([numerator_masks[i] for i in members])
        # the step as one rank's rows: the same layout (groups consecutive) and token_weights call as
        # the verl and AReaL plug-ins', coefficients back in the members' order
        weights = dp_step_weights(den, num, lengths, [group_ids[i] for i in members] if grouped else None,
                                  mode=objective.mode, divisor=objective.divisor)
        cu = exclusive_cumsum(lengths)
        for k, i in enumerate(members):
            coef = weights.coef[int(cu[k]):int(cu[k + 1])]
            c_i = float(coef.max()) if coef.numel() else 0.0
            if c_i <= 0.0:  # no numerator token: adds nothing
                continue
            out[i] = weights.pg_weight / (step_sizes[s] * c_i)
            if out[i] < 1.0 - CLAMP_SLACK:
                low.append((names[i], s, out[i]))
    if low:
        formula = _FORMULA[objective.mode].format(R=host.step_symbol, size=host.step_size) + (
            f", L = {objective.divisor:g}" if objective.mode == CONSTANT else "")
        raise host.error(
            f"megatron_pg_agg cannot make {host.owner} loss exact for this rollout: {objective.mode} needs "
            f"rollout_mask_sums D_i = {formula} >= 1, because {host.owner} get_sum_of_sample_mean divides by "
            f"clamp_min(D_i, 1); below 1 it would train another objective. Too small: " + "; ".join(
                f"{name} (step {s}): D_i = {d:.4g}" for name, s, d in low[:20])
            + (f" and {len(low) - 20} more" if len(low) > 20 else "")
            + ". Lower --global-batch-size, or choose a mode (or a larger pg_agg_divisor) whose D_i stay >= 1")
    return out
