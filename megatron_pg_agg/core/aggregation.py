r"""Policy-gradient loss aggregation: the contract, in one place.

Notation for one optimizer step (all microbatches and ranks together):

- ``l_t`` per-token loss; ``n_t`` numerator mask (the loss mask after filtering: M2PO, rejection
  sampling); ``d_t`` denominator mask (the original loss mask), ``n_t <= d_t``. A filtered token
  leaves the numerator and keeps its place in the denominator.
- units: a sequence ``s`` (one response) or a prompt group ``g`` (consecutive responses to one
  prompt, ragged sizes allowed). ``N_u = sum_{t in u} n_t l_t``, ``D_u = sum_{t in u} d_t``;
  a unit is *active* when ``D_u > 0``. ``L`` is the fixed divisor of ``constant``.

==============  ================================================  =====================
mode            objective J                                       weight W
==============  ================================================  =====================
token_mean      sum_t n_t l_t / sum_t d_t                         valid tokens
seq_mean        mean over active s of N_s / D_s                   active sequences
prompt_mean     mean over active g of N_g / D_g (pooled tokens)   active groups
constant        sum_t n_t l_t / (active sequences * L)            active sequences
==============  ================================================  =====================

Inactive units add nothing to J or W; a step with W = 0 has J = 0 and zero gradients. Masked
positions may hold NaN/inf: they are removed with ``torch.where``, never multiplied by 0.

Two equivalent forms:

*Local form* (:func:`aggregate`): one call sees whole units and returns ``(local_mean, weight)``;
parts combine as ``sum(local_mean * weight) / sum(weight)``.

*Token form* (:func:`token_weights` + :func:`weighted_sum`): every mode is
``J = sum_t c_t where(n_t, l_t, 0) / sum_t k_t`` with a float coefficient ``c_t`` (1, 1/D_s(t),
1/D_g(t) or 1/L) and an integer count ``k_t`` (``d_t`` for token_mean; otherwise 1 on the first
denominator-valid token of each active unit, 0 elsewhere). ``c`` and ``k`` depend only on masks
and boundaries, so they are computed once per step on the host; then ANY partition of the tokens
(microbatches, DP ranks, CP shards, a sequence cut in two) gives exactly J when each part returns
``(sum c*l, sum k)`` and the parts are summed. That is Megatron-core's
``calculate_per_token_loss`` contract: the loss sum is back-propagated as is, and the integer count
is summed over microbatches and DP x CP ranks by ``finalize_model_grads``, which divides the
gradients by it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .modes import CONSTANT, PROMPT_MEAN, TOKEN_MEAN, resolve_mode
from .segments import exclusive_cumsum, segment_ids
from .token_layout import GroupSizes, TokenLayout, _as_bool_mask, build_layout, check_loss, should_validate

__all__ = ["TokenWeights", "aggregate", "token_weights", "weighted_sum"]


@dataclass(frozen=True)
class TokenWeights:
    """Per-token coefficients and counts of one step: see the token form in the module docstring.

    Index or slice it exactly like the token tensors it describes (``w[rows]``, ``w[a:b]``,
    ``w[index_tensor]``) to get the weights of a part.
    """

    coef: torch.Tensor
    """float32, the mask's shape: ``c_t`` where the numerator mask is true, 0 elsewhere."""
    count: torch.Tensor
    """int32, the mask's shape: ``k_t``; summed over all parts it is the step's weight W."""
    mode: str = TOKEN_MEAN
    """The canonical mode the weights were built for (token_mean lets weighted_sum skip c)."""

    def __getitem__(self, index) -> "TokenWeights":
        return TokenWeights(self.coef[index], self.count[index], self.mode)

    @property
    def shape(self) -> torch.Size:
        return self.coef.shape

    def to(self, *args, **kwargs) -> "TokenWeights":
        """Move both tensors (``device`` / ``non_blocking`` only: dtypes are part of the contract)."""
        return TokenWeights(self.coef.to(*args, **kwargs), self.count.to(*args, **kwargs), self.mode)

    def reshape(self, *shape) -> "TokenWeights":
        return TokenWeights(self.coef.reshape(*shape), self.count.reshape(*shape), self.mode)

    @staticmethod
    def cat(parts: "list[TokenWeights]") -> "TokenWeights":
        """Concatenate the weights of packed parts (in the order their tokens are concatenated)."""
        modes = {p.mode for p in parts}
        if len(modes) != 1:
            raise ValueError(f"cannot concatenate TokenWeights of different modes: {sorted(modes)}")
        return TokenWeights(
            torch.cat([p.coef for p in parts]), torch.cat([p.count for p in parts]), modes.pop()
        )


def _prefix_counts(d: torch.Tensor) -> torch.Tensor:
    """int32 ``[T+1]`` exclusive prefix sums of the denominator mask (exact; int32 because an
    int64 cumsum is several times slower on CPU, and the layout check bounds T below 2**31)."""
    return exclusive_cumsum(d, torch.int32)


def _group_bounds(layout: TokenLayout) -> torch.Tensor:
    """int64 ``[G+1]``: sequence index where each prompt group starts (and the end)."""
    return exclusive_cumsum(layout.group_sizes)


def _inverse(denominators: torch.Tensor) -> torch.Tensor:
    """float32 1/D_u for active units, 0 for inactive ones (D_u = 0)."""
    return torch.where(
        denominators > 0,
        1.0 / denominators.clamp(min=1).to(torch.float32),
        torch.zeros((), dtype=torch.float32, device=denominators.device),
    )


def _unit_coef_and_first(d: torch.Tensor, prefix: torch.Tensor, unit_cu: torch.Tensor):
    """For units bounded by token offsets ``unit_cu``: per token 1/D_u (0 if inactive) and a flag
    on the first denominator-valid token of each unit."""
    start_count = prefix[unit_cu[:-1]]
    inv = _inverse(prefix[unit_cu[1:]] - start_count)
    unit_of_token = segment_ids(unit_cu, d.numel())
    first = d & (prefix[:-1] == start_count[unit_of_token])
    return inv[unit_of_token], first


def _weights_from_layout(layout: TokenLayout, mode: str, divisor: Optional[float]) -> TokenWeights:
    n, d = layout.numerator, layout.denominator
    zero = torch.zeros((), dtype=torch.float32, device=n.device)
    if mode == TOKEN_MEAN:
        coef, count = n.to(torch.float32), d.to(torch.int32)
    else:
        unit_cu = layout.cu_seqlens
        if mode == PROMPT_MEAN:
            unit_cu = unit_cu[_group_bounds(layout)]
        inv, first = _unit_coef_and_first(d, _prefix_counts(d), unit_cu)
        if mode == CONSTANT:  # 1/L on every numerator token, counted once per active sequence
            inv = torch.full((), 1.0 / divisor, dtype=torch.float32, device=n.device)
        coef, count = torch.where(n, inv, zero), first.to(torch.int32)
    return TokenWeights(coef.reshape(layout.shape), count.reshape(layout.shape), mode)


def _step_layout(
    loss_mask: torch.Tensor,
    loss: Optional[torch.Tensor] = None,
    /,
    *,
    mode: str = TOKEN_MEAN,
    cu_seqlens: Optional[torch.Tensor] = None,
    group_sizes: GroupSizes = None,
    divisor: Optional[float] = None,
    denominator_mask: Optional[torch.Tensor] = None,
    validate: Optional[bool] = None,
) -> tuple[TokenLayout, str, Optional[float]]:
    """The checked layout, mode and divisor of a step or part: the keyword arguments of
    :func:`token_weights` and :func:`aggregate`, their names and defaults written here once
    (``loss``, :func:`aggregate`'s, is positional-only: no keyword of theirs can pass it)."""
    mode, divisor = resolve_mode(mode, divisor)
    layout = build_layout(loss_mask, mode=mode, cu_seqlens=cu_seqlens, group_sizes=group_sizes,
                          denominator_mask=denominator_mask, validate=validate, loss=loss)
    return layout, mode, divisor


def token_weights(loss_mask: torch.Tensor, **step) -> TokenWeights:
    """Per-token ``(coef, count)`` for a whole optimizer step (token form, module docstring).

    Call it once per step, before the step is cut into microbatches, ranks or CP shards; slice the
    result like the token tensors. ``loss_mask`` is the numerator mask. Keyword arguments:
    ``mode`` (default token_mean); ``denominator_mask``, the original mask (defaults to
    ``loss_mask``); ``cu_seqlens``: masks are padded ``[B, S]`` (rows are sequences) or packed
    ``[T]`` with ``cu_seqlens [S+1]`` (required by every mode but token_mean); ``group_sizes``,
    consecutive sequences per prompt group (required by prompt_mean); ``divisor`` (constant's
    ``L``); ``validate=None`` runs the value checks on host tensors only (see
    :mod:`megatron_pg_agg.core.token_layout`).
    """
    return _weights_from_layout(*_step_layout(loss_mask, **step))


class _MaskedDot(torch.autograd.Function):
    """``sum_t where(n_t, l_t * c_t, 0)`` in float32, with a backward that allocates one gradient
    (``where(n, g * c, 0)``) and saves nothing new: autograd's default for the composed ops keeps
    an extra per-token temporary alive in the backward, 4 bytes per token at the peak."""

    @staticmethod
    def forward(ctx, loss, numerator, coef):
        ctx.save_for_backward(numerator, coef)
        ctx.loss_dtype = loss.dtype
        return torch.where(numerator, loss * coef, 0.0).sum(dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        numerator, coef = ctx.saved_tensors
        return torch.where(numerator, coef * grad, 0.0).to(ctx.loss_dtype), None, None


def _masked_weighted_sum(loss: torch.Tensor, numerator: torch.Tensor, weights: TokenWeights):
    if weights.mode == TOKEN_MEAN:  # c_t is exactly the mask: skip the multiply
        loss_sum = torch.where(numerator, loss, 0.0).sum(dtype=torch.float32)
    else:
        loss_sum = _MaskedDot.apply(loss, numerator, weights.coef)
    return loss_sum, weights.count.sum(dtype=torch.int32)


def weighted_sum(
    loss: torch.Tensor,
    loss_mask: torch.Tensor,
    weights: TokenWeights,
    *,
    validate: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One part's ``(sum_t c_t * where(n_t, l_t, 0), sum_t k_t)``: float32 scalar, int32 scalar.

    ``weights`` is the step's :class:`TokenWeights` sliced to this part. Summing both outputs over
    any partition of the step's tokens and dividing gives the step objective J exactly (up to
    float32 summation order). No host sync, no data-dependent shape.
    """
    check_loss(loss)
    if not isinstance(weights, TokenWeights):
        raise TypeError(f"weights must be TokenWeights (from token_weights()); got {type(weights).__name__}")
    if loss.shape != weights.shape:
        raise ValueError(
            f"loss shape {tuple(loss.shape)} must equal weights shape {tuple(weights.shape)}: "
            "slice the step's TokenWeights the same way as the loss"
        )
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.shape != loss.shape:
        shape = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask).__name__
        raise ValueError(f"loss_mask shape {shape} must equal loss shape {tuple(loss.shape)}")
    numerator = _as_bool_mask(loss_mask, "loss_mask", should_validate(validate, loss_mask))
    return _masked_weighted_sum(loss, numerator, weights)


def aggregate(loss: torch.Tensor, loss_mask: torch.Tensor, **step) -> tuple[torch.Tensor, torch.Tensor]:
    """Local form: ``(local_mean, weight)`` for a call that holds whole units.

    ``weight`` is an int32 scalar (valid tokens, active sequences or active groups) and
    ``local_mean`` is 0 when it is 0. Parts combine as ``sum(mean * weight) / sum(weight)``.
    token_mean keeps the loss dtype and equals ``where(mask, loss, 0).sum() / count`` exactly;
    the other modes compute in float32. Keyword arguments as in :func:`token_weights`.
    """
    check_loss(loss)
    layout, mode, divisor = _step_layout(loss_mask, loss, **step)
    if mode == TOKEN_MEAN:
        weight = layout.denominator.sum(dtype=torch.int32)
        loss_sum = torch.where(layout.numerator.reshape(loss.shape), loss, 0.0).sum()
        return loss_sum / weight.clamp(min=1), weight
    return _local_unit_mean(loss.reshape(-1), layout, mode, divisor)


def _local_unit_mean(loss: torch.Tensor, layout: TokenLayout, mode: str, divisor: Optional[float]):
    """seq_mean / prompt_mean / constant on whole units: per-unit numerator sums by
    ``segment_reduce`` over the boundaries (one pass, backward is a broadcast; ``unsafe=True``
    skips its lengths-sum check, which would be a device->host sync: the layout was checked on
    the host), exact integer denominators from a prefix count."""
    cu = layout.cu_seqlens
    masked = torch.where(layout.numerator, loss.to(torch.float32), 0.0)
    prefix = _prefix_counts(layout.denominator)
    if mode == CONSTANT:  # no per-unit numerator needed: inactive sequences have N_s = 0
        weight = (prefix[cu[1:]] > prefix[cu[:-1]]).sum(dtype=torch.int32)
        return masked.sum() * (1.0 / divisor) / weight.clamp(min=1), weight
    numerators = torch.segment_reduce(masked, "sum", offsets=cu, unsafe=True, initial=0.0)
    if mode == PROMPT_MEAN:
        bounds = _group_bounds(layout)
        numerators = torch.segment_reduce(numerators, "sum", offsets=bounds, unsafe=True, initial=0.0)
        cu = cu[bounds]
    denominators = prefix[cu[1:]] - prefix[cu[:-1]]
    weight = (denominators > 0).sum(dtype=torch.int32)
    loss_sum = (numerators * _inverse(denominators)).sum()
    return loss_sum / weight.clamp(min=1), weight
