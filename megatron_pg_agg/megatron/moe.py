"""Mixture-of-experts helpers for training loops: the per-step aux-loss factor and exact logging.

WHY
    A MoE router adds its load-balancing (aux) and z losses to the gradient. Under the exact
    aggregation those must keep Megatron's default strength, ``1 / M_total`` per microbatch loss
    (the ``moe_aux_loss`` patch, :mod:`megatron_pg_agg.patches.moe_aux_loss`, explains why and
    how); the training loop sets the step's factor once per step (:func:`begin_moe_step`). Their
    values are logged as ``[sum, count]`` pairs (:func:`router_loss_pairs`) so a logger that sums
    pairs over ranks and divides once gets exactly Megatron's logged value: the mean over MoE
    layers, microbatches and DP ranks of each microbatch's loss (divided by its coefficient, as
    Megatron logs it).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter

from megatron_pg_agg.patches.moe_aux_loss import clear_moe_aux_loss_scale, moe_aux_loss_scale, set_moe_aux_loss_scale

__all__ = [
    "ROUTER_LOSS_NAMES",
    "begin_moe_step",
    "clear_moe_aux_loss_scale",
    "has_experts",
    "router_loss_pairs",
    "router_loss_values",
    "set_moe_aux_loss_scale",
    "step_factor",
]

ROUTER_LOSS_NAMES = {
    "load_balancing_loss": "moe_aux_loss",
    "seq_load_balancing_loss": "moe_seq_aux_loss",
    "global_load_balancing_loss": "moe_global_aux_loss",
    "z_loss": "moe_z_loss",
}
"""Megatron's tracker name -> the metric name reported here (fixed order: one tensor per step)."""


def has_experts(config) -> bool:
    """Whether the model config has MoE layers."""
    return bool(getattr(config, "num_moe_experts", None))


def begin_moe_step(pg_weight: int, microbatches_per_rank: int, dp_size: int) -> float:
    """Set this step's aux-loss factor ``W / (microbatches_per_rank * dp_size)`` (see
    :func:`~megatron_pg_agg.patches.moe_aux_loss.set_moe_aux_loss_scale`); return it."""
    return set_moe_aux_loss_scale(int(pg_weight), int(microbatches_per_rank) * int(dp_size))


def _local_routers(model_chunks) -> int:
    return sum(1 for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter))


def router_loss_pairs(model_chunks, num_microbatches: int, *, device=None) -> torch.Tensor:
    """This rank's ``[sum, count]`` per name of :data:`ROUTER_LOSS_NAMES` (a ``[4, 2]`` float64
    tensor), read from megatron-core's aux-loss tracker, which is then cleared for the next step.

    Sum the result over ALL ranks (one all-reduce over the world); ``sum / count`` is then
    Megatron's logged value. A name whose loss is off has count 0. Sums: the tracker holds, per
    layer, the microbatches' losses; a loss computed on a shard of the tokens (aux losses: each
    rank of the router's reduce group holds a partial sum) adds up over that group, so its count
    comes from the group's first rank only; a loss computed whole on every rank (z-loss, per TP
    rank) is counted on every rank, so the ratio is the mean. Call after the schedule, on every
    rank, after each training step (no collective here; no host sync).
    """
    tracker, clear = _router_loss_tracker()
    out = torch.zeros(len(ROUTER_LOSS_NAMES), 2, dtype=torch.float64, device=device)
    routers = _local_routers(model_chunks)
    for i, name in enumerate(ROUTER_LOSS_NAMES):
        entry = tracker.get(name)
        if entry is None or routers == 0:
            continue
        values, group = entry
        out[i, 0] = values.double().sum().to(out.device)
        first = group is None or dist.get_rank(group=group) == 0
        out[i, 1] = float(routers * num_microbatches) if first else 0.0
    clear()
    return out


def _router_loss_tracker():
    """``({name: (per-layer values, reduce group)}, clear)`` of megatron-core's router-loss
    tracker, looked up per release: from 0.18 it is ``moe_logging.get_moe_metrics_tracker()``
    (``moe_utils.clear_aux_losses_tracker`` is then a deprecated wrapper that warns on every call);
    up to 0.17 the ``moe_utils`` functions."""
    try:
        # looked up per release, at the call: the module exists from 0.18 only
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker  # noqa: PLC0415
    except ImportError:  # megatron-core <= 0.17
        from megatron.core.transformer.moe.moe_utils import (  # noqa: PLC0415
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        legacy = get_moe_layer_wise_logging_tracker()
        return {k: (e["values"], e.get("reduce_group")) for k, e in legacy.items()}, clear_aux_losses_tracker
    tracker = get_moe_metrics_tracker()
    return {k: (e.values, e.reduce_group) for k, e in tracker.metrics.items()}, tracker.clear


def router_loss_values(pairs: torch.Tensor) -> dict:
    """``{metric name: [sum, count]}`` of the world-reduced pairs, for names with a count."""
    values = pairs.tolist()
    return {metric: values[i] for i, metric in enumerate(ROUTER_LOSS_NAMES.values()) if values[i][1] > 0}


def step_factor() -> Optional[float]:
    """The aux-loss factor currently set (None: none)."""
    return moe_aux_loss_scale()
