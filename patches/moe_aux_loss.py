"""MoE router auxiliary and z losses keep Megatron's default strength under the exact aggregation.

WHY
    With ``config.calculate_per_token_loss=True`` megatron-core 0.16 (1) multiplies each router
    aux loss (``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``) and the z-loss by the number of
    tokens the router routed in that microbatch (``TopKRouter.attach_and_log_load_balancing_loss``
    and ``TopKRouter.apply_z_loss``, router.py ~456-466 and ~488-498), (2) sets
    ``MoEAuxLossAutoScaler``'s backward scale to 1 (schedules.py ~289-292), and (3)
    ``finalize_model_grads`` divides every gradient by the step's global count. Upstream's
    comment states the intent: a final aux scale of ``1 / (num_micro_batches * dp_size)``; the
    token multiply achieves it only when the global count is the number of routed tokens. In this
    project the count is the policy-gradient weight ``W`` (valid tokens, active sequences or
    active groups), so the load-balancing gradient comes out scaled by about
    ``N_routed / (W * tp_sp * cp)``: measured 1.35x to thousands of times Megatron's default, and
    non-zero on a ``W = 0`` step whose gradients must be zero (docs/moe.md).

WHAT (the reference semantics)
    The aux and z losses belong to the router and the tokens it routes, not to the policy-gradient
    objective. Their gradient is what Megatron's default averaging gives, whatever the mode:
    ``(1 / M_total) * sum over the step's microbatches of grad(aux_mb)``, ``M_total`` the number
    of microbatches over all DP ranks (per DP rank x DP size). A ``W = 0`` step has zero
    gradients, aux included.

HOW (wrappers only, never a copy of an upstream function)
    * ``TopKRouter.attach_and_log_load_balancing_loss`` and ``TopKRouter.apply_z_loss`` run with
      the router's instance attribute ``calculate_per_token_loss`` set to False for the duration
      of the call (it is read only at those two places): the loss is attached unscaled, and
      logged exactly as upstream logs it.
    * ``MoEAuxLossAutoScaler.set_loss_scale(scale)`` (the schedule calls it after every forward
      with the main loss scale, 1 without a grad scaler) stores ``scale * W / M_total``.
      ``finalize_model_grads`` then divides by ``W`` (summed over DP x CP; DDP sums the
      gradients there), leaving ``1 / M_total`` exactly as Megatron's default does. With
      ``W = 0`` the scale is 0 and the aux gradients are exactly zero.

    Design choices:
    * The factor is per STEP, not per microbatch: ``main_loss_backward_scale`` is one tensor
      shared by every microbatch, and under 1F1B a later forward resets it before an earlier
      microbatch's backward reads it; a per-step constant is right whatever the order.
    * It is set from host integers the planner already knows (``StepTotals.pg_weight`` and the
      microbatch count), so no collective and no host sync: a Python float times the schedule's
      device tensor. :func:`set_moe_aux_loss_scale` takes ``(pg_weight, total_microbatches)`` and
      needs no process group, so any training loop (this project's trainer, a Megatron-LM
      ``forward_step``) can call it once per step.
    * The scale is applied in ``set_loss_scale`` rather than by scaling the loss in the router,
      so the values the router logs (``save_to_aux_losses_tracker``) stay upstream's.
    * Misuse is loud: a router attaching an aux/z loss under ``calculate_per_token_loss=True``
      while no step factor is set (the gradient would silently be ``1 / W`` instead of
      ``1 / M_total``), or under ``calculate_per_token_loss=False`` while one is set (it would
      rescale Megatron's own averaging), raises ``RuntimeError``.

TARGETS (megatron-core >=0.15.0,<0.20; the same on every release)
    ``megatron.core.transformer.moe.router.TopKRouter.attach_and_log_load_balancing_loss``,
    ``megatron.core.transformer.moe.router.TopKRouter.apply_z_loss``,
    ``megatron.core.transformer.moe.moe_utils.MoEAuxLossAutoScaler.set_loss_scale``.
    Any device (no CUDA assumption). Multi-token prediction (its own ``MTPLossAutoScaler``) is
    not covered: ``check_megatron_config`` refuses ``mtp_num_layers``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..versions import SUPPORTED_MEGATRON_CORE
from ._machinery import Patch, Target, is_applied
from ._step_factor import make_scaled_set_loss_scale, require_host_ints

NAME = "moe_aux_loss"
SUPPORTED = SUPPORTED_MEGATRON_CORE

_ROUTER = "megatron.core.transformer.moe.router"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"

_STEP_SCALE: Optional[float] = None
"""``W / M_total`` of the current step, or None when no step factor is set."""


def set_moe_aux_loss_scale(pg_weight: int, total_microbatches: int) -> float:
    """Set this step's aux/z-loss factor ``pg_weight / total_microbatches``; return it.

    Call once per optimizer step, before the forward-backward schedule, on every rank:
    ``pg_weight`` is the step's global weight ``W`` (``StepTotals.pg_weight``), and
    ``total_microbatches`` is the number of microbatches over all DP ranks (microbatches per DP
    rank x DP size, context-parallel ranks not counted). Both are host integers; nothing is
    communicated. Takes effect only while the ``moe_aux_loss`` patch is applied.
    """
    global _STEP_SCALE
    require_host_ints(pg_weight=pg_weight, total_microbatches=total_microbatches)
    if pg_weight < 0:
        raise ValueError(f"pg_weight must be >= 0, got {pg_weight}")
    if total_microbatches < 1:
        raise ValueError(f"total_microbatches must be >= 1, got {total_microbatches}")
    _STEP_SCALE = int(pg_weight) / int(total_microbatches)
    return _STEP_SCALE


def clear_moe_aux_loss_scale() -> None:
    """Forget the step factor (before a run under Megatron's default averaging)."""
    global _STEP_SCALE
    _STEP_SCALE = None


def moe_aux_loss_scale() -> Optional[float]:
    """The current step factor ``W / M_total``, or None."""
    return _STEP_SCALE


def is_active() -> bool:
    """Whether the patch is applied."""
    return is_applied(NAME)


def _check_step_factor(router) -> None:
    per_token = bool(getattr(router.config, "calculate_per_token_loss", False))
    if per_token and _STEP_SCALE is None:
        raise RuntimeError(
            "moe_aux_loss: a router attaches an aux/z loss under calculate_per_token_loss=True but "
            "no step factor is set; call megatron_pg_agg.patches.moe_aux_loss."
            "set_moe_aux_loss_scale(pg_weight, total_microbatches) once per step before the "
            "schedule (otherwise the aux gradient would be 1/W instead of Megatron's 1/M_total)."
        )
    if not per_token and _STEP_SCALE is not None:
        raise RuntimeError(
            "moe_aux_loss: a step factor is set but this model runs Megatron's default averaging "
            "(calculate_per_token_loss=False), which scales the aux loss itself; call "
            "clear_moe_aux_loss_scale() first."
        )


def _make_router_call(original):
    """Run a router method with the token multiply off (the instance attribute upstream reads)."""

    def router_call(self, *args, **kwargs):
        _check_step_factor(self)
        saved = self.calculate_per_token_loss
        self.calculate_per_token_loss = False
        try:
            return original(self, *args, **kwargs)
        finally:
            self.calculate_per_token_loss = saved

    return router_call


def _make_z_loss(original):
    """``apply_z_loss`` runs on every forward; check the step factor only when it attaches a loss
    (the condition upstream tests), then run it with the token multiply off."""
    call = _make_router_call(original)

    def apply_z_loss(self, logits, *args, **kwargs):
        if self.config.moe_z_loss_coeff is not None and self.training and torch.is_grad_enabled():
            return call(self, logits, *args, **kwargs)
        return original(self, logits, *args, **kwargs)

    return apply_z_loss


PATCH = Patch(
    name=NAME,
    supported=SUPPORTED,
    why=__doc__,
    targets=(
        Target(_ROUTER, "TopKRouter.attach_and_log_load_balancing_loss", _make_router_call),
        Target(_ROUTER, "TopKRouter.apply_z_loss", _make_z_loss),
        # stores scale * W / M_total while a step factor is set
        Target(_MOE_UTILS, "MoEAuxLossAutoScaler.set_loss_scale", make_scaled_set_loss_scale(lambda: _STEP_SCALE)),
    ),
)
