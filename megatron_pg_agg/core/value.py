r"""The critic's value loss, aggregated under the policy term's contract.

Per token (``V`` the value head's output, ``V_old`` the value recorded before the update, ``R`` the
return, ``eps`` the value clip range, ``h`` the host's factor)::

    unclipped:  v_t = h (V - R)^2
    clipped:    v_t = h max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)

PPO's clipped value loss. Every host writes the clip as a clamp of ``V`` into ``V_old +- eps``
(AReaL's ``V_old + clamp(V - V_old, -eps, eps)`` is the same number); they differ in ``h``: 0.5 in
AReaL (inside each square), verl (outside the max) and NeMo-RL (times its ``scale``), 1 in slime.
A Huber value loss is refused: AReaL 1.0.4 has a ``_huber_loss`` that no config key selects, and no
other host offers one.

The value term aggregates exactly as the policy term (:mod:`megatron_pg_agg.core.aggregation`):

    J_v = sum_t c^v_t where(n_t, v_t, 0) / W^v

with ``c^v`` and ``W^v`` the :func:`~megatron_pg_agg.core.aggregation.token_weights` of the value
term's own mode over the step (its numerator and denominator masks, units and groups are the
policy term's), so any partition of the step's tokens summing ``(sum c^v v, sum k^v)`` gives
``J_v``. The value mode defaults to the policy's (verl's ``critic.loss_agg_mode`` inherits the
actor's in the same way): a critic trained in another mode than the actor is a choice, never a
default.

Elementwise, no host sync: the same per-token contract as :func:`megatron_pg_agg.core.losses.pg_loss_sum`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .aggregation import TokenWeights, weighted_sum
from .modes import resolve_mode

__all__ = ["VALUE_LOSSES", "ValueLossConfig", "value_token_losses", "value_loss_sum"]

VALUE_LOSSES = ("mse",)
"""The per-token value losses offered (``mse``: the squared error above)."""


@dataclass(frozen=True)
class ValueLossConfig:
    """What the critic optimises. Validated on construction (host side, before any step)."""

    mode: Optional[str] = None
    """Aggregation mode of the value term (token_mean, seq_mean, prompt_mean, constant, or a peer
    alias); None: the policy term's, filled in by :meth:`with_policy_mode`."""
    divisor: Optional[float] = None
    """constant's L for the value term; None for every other mode (or with ``mode`` None)."""
    clip_eps: Optional[float] = None
    """``eps``: the value clip range around ``V_old``; None: the unclipped loss."""
    factor: float = 0.5
    """``h``: 0.5 (AReaL, verl, NeMo-RL) or 1 (slime)."""
    loss: str = "mse"
    """The per-token loss: ``mse`` only (a Huber loss is refused: module docstring)."""

    def __post_init__(self) -> None:
        if self.loss not in VALUE_LOSSES:
            raise ValueError(f"value loss {self.loss!r} is not offered: only {VALUE_LOSSES} (a Huber value loss, "
                             "AReaL's unused _huber_loss, is selected by no host's config)")
        if self.mode is not None:
            mode, divisor = resolve_mode(self.mode, self.divisor)
            object.__setattr__(self, "mode", mode)
            object.__setattr__(self, "divisor", divisor)
        elif self.divisor is not None:
            raise ValueError("a value divisor goes with a value mode (constant); with mode None the policy's is used")
        if self.clip_eps is not None and not self.clip_eps > 0:
            raise ValueError(f"clip_eps must be positive or None (unclipped); got {self.clip_eps}")
        if not self.factor > 0:
            raise ValueError(f"factor must be positive (0.5 or 1); got {self.factor}")

    def with_policy_mode(self, mode: str, divisor: Optional[float] = None) -> "ValueLossConfig":
        """This config with the policy's mode (and divisor) where its own mode is None."""
        if self.mode is not None:
            return self
        return ValueLossConfig(mode, divisor, self.clip_eps, self.factor, self.loss)


def value_token_losses(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       cfg: ValueLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token ``(v_t, clipped_t)`` (module docstring): float32 losses, and where the clipped
    branch is the larger (the clip fraction's numerator; all False unclipped). Inputs at masked
    positions must be finite (they are removed with ``torch.where`` afterwards)."""
    values = values.float()
    error = (values - returns.float()).square()
    if cfg.clip_eps is None:
        return cfg.factor * error, torch.zeros_like(error, dtype=torch.bool)
    old = old_values.float()
    clipped_values = torch.minimum(torch.maximum(values, old - cfg.clip_eps), old + cfg.clip_eps)
    clipped_error = (clipped_values - returns.float()).square()
    return cfg.factor * torch.maximum(error, clipped_error), clipped_error > error


def value_loss_sum(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, numerator_mask: torch.Tensor,
                   weights: TokenWeights, cfg: ValueLossConfig) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One part's ``(loss_sum, count, report)`` of the value term in Megatron-core's per-token
    contract: ``sum_t c^v_t where(n_t, v_t, 0)`` (float32) and ``sum_t k^v_t`` (int32), ``weights``
    the step's value-mode :class:`~megatron_pg_agg.core.aggregation.TokenWeights` sliced to this
    part. ``report``: detached ``[sum, count]`` pairs ``value_loss`` (J_v), ``clip_fraction``
    (over numerator tokens)."""
    losses, clipped = value_token_losses(values, old_values, returns, cfg)
    loss_sum, count = weighted_sum(losses, numerator_mask, weights, validate=False)
    tokens = numerator_mask.sum(dtype=torch.float32)
    report = {"value_loss": torch.stack([loss_sum.detach(), count.to(torch.float32)]),
              "value_clip_fraction": torch.stack([(clipped & numerator_mask).sum(dtype=torch.float32), tokens])}
    return loss_sum, count, report
