"""Multi-token prediction (MTP): its loss is a token mean over the step's valid response tokens,
whatever the policy-gradient mode.

WHY
    megatron-core attaches the MTP loss to the decoder's hidden states through
    ``MTPLossAutoScaler`` (multi_token_prediction.py), never through the loss function: per MTP
    depth ``k`` (1..K) it rolls the labels and the loss mask ``k`` places left within each packed
    sequence and attaches ``(f / K) * sum_t m_k[t] CE_k[t]`` (``f`` =
    ``config.mtp_loss_scaling_factor``). With ``calculate_per_token_loss=True`` the schedule sets
    the scaler's backward scale to the main loss scale (1 without a grad scaler) and
    ``finalize_model_grads`` divides every gradient by the step's all-reduced count. Megatron's
    intent is a token mean: the count is the number of loss tokens. In this project the count is
    the policy-gradient weight ``W`` (valid tokens, active sequences, active groups or
    sequences with a divisor), so the MTP gradient would come out scaled by ``D / W`` (``D`` the
    step's valid tokens): the mean response length under seq_mean, and 0/0 on a ``W = 0`` step.
    Two more release-specific defects:

    * 0.17 to 0.19 (``process_mtp_loss``) multiply each microbatch's attached loss by
      ``original_count / rolled_count`` of that microbatch and context-parallel rank
      (Megatron-LM #3159): a local ratio, so the MTP gradient depends on how the step is cut
      into microbatches whenever a sequence's first ``k`` label positions are masked.
    * 0.16 to 0.19 roll packed sequences on ``cu_seqlens_q`` (the real lengths) while the tokens
      are laid out on ``cu_seqlens_q_padded``. This project pads every sequence for sequence and
      context parallelism, and pads microbatches to the pipeline buffer, so the roll would move
      labels and masks across sequence boundaries and into padding (upstream's fix, Megatron-LM
      #4494, is not in 0.19.2).

WHAT (the reference semantics)
    ``dJ_mtp/dtheta = (f / K) * sum_k sum_t d_k[t] grad CE_k[t] / D``: ``d`` is the step's
    denominator mask (label-aligned: position ``P + j - 1`` of a sequence scores its response
    token ``j``; prompt tokens and padding are 0), ``d_k`` it rolled ``k`` places left within its
    own sequence (the last ``k`` positions of the sequence read 0), ``D = sum_t d[t]`` over the
    step (``StepTotals.valid_tokens``). This is what megatron-core 0.16 gives in a plain token-mean
    run with ``calculate_per_token_loss`` (count ``D``), whatever the policy-gradient mode and
    layout here. When every prompt has at least ``K + 1`` tokens, ``sum_t d_k[t] = D`` for every
    depth, so each depth is an exact token mean (and 0.17+'s ratio is 1). A ``W = 0`` step has
    ``D = 0`` and zero MTP gradients.

HOW (wrappers only, never a copy of an upstream function)
    * ``MTPLossAutoScaler.set_loss_scale(scale)`` (the schedule calls it after every forward,
      on every stage) stores ``scale * W / D`` while a step factor is set
      (:func:`set_mtp_loss_scale`); ``finalize_model_grads`` then divides by ``W``, leaving
      ``1 / D``. The factor is per step, not per microbatch (the scale is one class attribute
      read at backward time, and under 1F1B a later forward resets it before an earlier
      backward), from host integers the planner knows: no collective, no host sync.
    * ``MTPLossAutoScaler.forward`` records the sum of each attached loss (a device tensor, no
      sync: :func:`take_attached_sum`), for the ``mtp_loss`` report. It raises when no step factor
      is set: the gradient would silently be ``1 / W`` instead of ``1 / D``.
    * 0.17+: ``process_mtp_loss`` (the name ``gpt_model`` calls) runs with a shallow copy of
      its config whose ``calculate_per_token_loss`` is False, and with ``roll_tensor``'s count
      read as 1 for the duration of the call, so it attaches ``(f / K) * sum_t m_k CE_k``, the
      plain masked sum 0.16's per-token branch attaches. (Its tracker then holds sums instead of
      per-microbatch means; the report here does not read the tracker.)
    * 0.16+: ``_roll_tensor_packed_seq`` (what ``roll_tensor`` calls for packed sequences) runs with
      ``cu_seqlens_q = cu_seqlens_q_padded`` when the padded boundaries are set: each sequence is
      rolled within its own padded slot.

    megatron-core 0.15 asserts that MTP does not support packed sequences
    (``MultiTokenPredictionLayer.forward``); every microbatch here is packed THD, so the patch
    supports 0.16 to 0.19 and the entries refuse MTP on 0.15 with that reason.

TARGETS (megatron-core >=0.16,<0.20)
    ``megatron.core.transformer.multi_token_prediction.MTPLossAutoScaler.set_loss_scale`` and
    ``.MTPLossAutoScaler.forward`` (every release), ``._roll_tensor_packed_seq`` (every release),
    ``.roll_tensor`` and ``megatron.core.models.gpt.gpt_model.process_mtp_loss`` (0.17+). Any
    device.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Optional

import torch

from ._machinery import Patch, Target, is_applied
from ._step_factor import make_scaled_set_loss_scale, plain_function, require_host_ints

NAME = "mtp_loss"
SUPPORTED = ">=0.16.0,<0.20"
UNSUPPORTED_REASON = ("megatron-core 0.15 refuses multi-token prediction with packed sequences "
                      "(MultiTokenPredictionLayer.forward asserts packed_seq_params is None), and every "
                      "microbatch here is packed THD; MTP needs megatron-core 0.16 or newer")

_MTP = "megatron.core.transformer.multi_token_prediction"
_GPT = "megatron.core.models.gpt.gpt_model"

_STEP_SCALE: Optional[float] = None
"""``W / D`` of the current step, or None when no step factor is set."""
_ATTACHED: list = []
"""float64 sums of the MTP losses attached since the last :func:`take_attached_sum`."""
_COUNT_AS_ONE = False
"""True while a wrapped ``process_mtp_loss`` runs: ``roll_tensor``'s count reads as 1."""


def set_mtp_loss_scale(pg_weight: int, valid_tokens: int) -> float:
    """Set this step's MTP factor ``pg_weight / valid_tokens`` (0 when ``valid_tokens`` is 0);
    return it.

    Call once per optimizer step, before the forward-backward schedule, on every rank:
    ``pg_weight`` is the step's global weight ``W`` (``StepTotals.pg_weight``), ``valid_tokens``
    its valid response tokens ``D`` (``StepTotals.valid_tokens``). Both are host integers;
    nothing is communicated. Takes effect only while the ``mtp_loss`` patch is applied.
    """
    global _STEP_SCALE
    require_host_ints(pg_weight=pg_weight, valid_tokens=valid_tokens)
    for name, value in (("pg_weight", pg_weight), ("valid_tokens", valid_tokens)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if (pg_weight == 0) != (valid_tokens == 0):
        raise ValueError(f"pg_weight={pg_weight} and valid_tokens={valid_tokens}: a step has W = 0 exactly "
                         "when it has no valid token")
    _STEP_SCALE = int(pg_weight) / int(valid_tokens) if valid_tokens else 0.0
    return _STEP_SCALE


def clear_mtp_loss_scale() -> None:
    """Forget the step factor and the recorded sums."""
    global _STEP_SCALE
    _STEP_SCALE = None
    _ATTACHED.clear()


def mtp_loss_scale() -> Optional[float]:
    """The current step factor ``W / D``, or None."""
    return _STEP_SCALE


def take_attached_sum(device=None) -> torch.Tensor:
    """float64 0-d: the sum of every MTP loss attached on this rank since the last call
    (``(f / K) * sum_k sum_t d_k CE_k`` over its microbatches), then forgotten. No host sync."""
    total = torch.stack(_ATTACHED).sum() if _ATTACHED else torch.zeros((), dtype=torch.float64, device=device)
    _ATTACHED.clear()
    return total


def is_active() -> bool:
    """Whether the patch is applied."""
    return is_applied(NAME)


def _make_forward(original):
    """``MTPLossAutoScaler.forward(ctx, output, mtp_loss)``: refuse without a step factor, record
    the attached loss's sum, then upstream's forward."""
    fn = plain_function(original)

    def forward(ctx, output, mtp_loss):
        if _STEP_SCALE is None:
            raise RuntimeError(
                "mtp_loss: an MTP loss is attached but no step factor is set; call "
                "megatron_pg_agg.patches.mtp_loss.set_mtp_loss_scale(pg_weight, valid_tokens) once per "
                "step before the schedule (otherwise the MTP gradient would be 1/W instead of 1/D)."
            )
        _ATTACHED.append(mtp_loss.detach().double().sum())
        return fn(ctx, output, mtp_loss)

    return forward


def _make_roll_packed(original):
    """Roll each packed sequence within its padded slot (``cu_seqlens_q_padded``)."""
    signature = inspect.signature(original)

    def _roll_tensor_packed_seq(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        params = bound.arguments["packed_seq_params"]
        if params is not None and getattr(params, "cu_seqlens_q_padded", None) is not None:
            bound.arguments["packed_seq_params"] = dataclasses.replace(
                params, cu_seqlens_q=params.cu_seqlens_q_padded)
        return original(*bound.args, **bound.kwargs)

    return _roll_tensor_packed_seq


def _make_roll_tensor(original):
    """``roll_tensor`` returns ``(rolled, count)``; inside a wrapped ``process_mtp_loss`` the
    count reads as 1 (the plain masked sum is attached, with no local count ratio)."""

    def roll_tensor(*args, **kwargs):
        rolled, count = original(*args, **kwargs)
        if _COUNT_AS_ONE and count is not None:
            count = torch.ones_like(count)
        return rolled, count

    return roll_tensor


def _make_process_mtp_loss(original):
    """Run ``process_mtp_loss`` on its non-per-token branch with counts of 1: the plain sum."""
    signature = inspect.signature(original)

    def process_mtp_loss(*args, **kwargs):
        global _COUNT_AS_ONE
        bound = signature.bind(*args, **kwargs)
        plain = copy.copy(bound.arguments["config"])  # shallow: the model's config is not touched
        plain.calculate_per_token_loss = False
        bound.arguments["config"] = plain
        _COUNT_AS_ONE = True
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            _COUNT_AS_ONE = False

    return process_mtp_loss


PATCH = Patch(
    name=NAME,
    supported=SUPPORTED,
    why=__doc__,
    unsupported_reason=UNSUPPORTED_REASON + ".",
    targets=(
        # stores scale * W / D while a step factor is set
        Target(_MTP, "MTPLossAutoScaler.set_loss_scale", make_scaled_set_loss_scale(lambda: _STEP_SCALE)),
        Target(_MTP, "MTPLossAutoScaler.forward", _make_forward),
        Target(_MTP, "_roll_tensor_packed_seq", _make_roll_packed),
        Target(_MTP, "roll_tensor", _make_roll_tensor, releases=">=0.17"),
        Target(_GPT, "process_mtp_loss", _make_process_mtp_loss, releases=">=0.17"),
    ),
)
