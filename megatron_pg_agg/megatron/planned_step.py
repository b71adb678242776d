"""The forward step and the per-iteration record of a loop that owns the schedule.

Megatron-LM's ``pretrain()`` (:mod:`megatron_pg_agg.training.megatron_lm`) and Megatron-Bridge's
``pretrain`` (:mod:`megatron_pg_agg.integrations.bridge.loop`) run megatron-core's
forward-backward schedule themselves, reduce the report pairs (``[sum, count]``, all-reduced over
DP x CP, ``sum / count``) and step the optimizer. What the project supplies there is written once
here: the forward step over the planned microbatches of a
:class:`~megatron_pg_agg.data.feed.RolloutFeed` (per-token loss of
:mod:`.loss_func` with the step's host totals; the MoE routers' and the MTP loss's per-step factors
set before a step's first forward), and the record of a finished iteration from the loop's reduced
losses.
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist

from megatron_pg_agg.core.losses import REPORT_KEYS, PGLossConfig, correction_values, report_values
from megatron_pg_agg.data.feed import PlannedMicrobatch

__all__ = ["PlannedForward", "iteration_record"]


class PlannedForward:
    """``forward(item, model) -> (output, loss_func)`` for one planned microbatch.

    ``num_microbatches`` / ``dp_size``: the run's microbatches per DP rank and DP size (the MoE
    factor's ``M_total``). ``moe`` / ``mtp``: the model has MoE routers / an MTP block (their
    per-step factors are set when a new iteration's first microbatch arrives: under 1F1B every
    backward of a step finishes before the optimizer step, so no later step's factor reaches
    them)."""

    def __init__(self, loss_cfg: PGLossConfig, *, cuda: bool, moe: bool, mtp: bool, num_microbatches: int,
                 dp_size: int):
        self.loss_cfg, self.cuda, self.moe, self.mtp = loss_cfg, cuda, moe, mtp
        self.num_microbatches, self.dp_size = num_microbatches, dp_size
        self._moe_iteration = self._mtp_iteration = None

    def __call__(self, item: PlannedMicrobatch, model):
        from megatron.core import parallel_state as mpu  # noqa: PLC0415  (megatron-core after the patches)

        from .loss_func import forward_microbatch, mtp_factor_of, pg_loss_func  # noqa: PLC0415

        if self.moe and item.iteration != self._moe_iteration:
            from .moe import begin_moe_step  # noqa: PLC0415

            begin_moe_step(item.totals.pg_weight, self.num_microbatches, self.dp_size)
            self._moe_iteration = item.iteration
        if self.mtp and item.iteration != self._mtp_iteration:
            from .mtp import begin_mtp_step  # noqa: PLC0415

            begin_mtp_step(item.totals)
            self._mtp_iteration = item.iteration
        mb = item.microbatch.to("cuda") if self.cuda else item.microbatch
        output = forward_microbatch(model, mb)
        return output, partial(pg_loss_func, mb, self.loss_cfg, item.totals,
                               mpu.get_tensor_model_parallel_group(),
                               cp_group=mpu.get_context_parallel_group(), mtp_factor=mtp_factor_of(model))


def iteration_record(loss_dict: dict, plan, *, iteration: int, mtp: bool, cuda: bool) -> tuple:
    """``(record, reduced)`` of a finished iteration, on every rank: the loop's reduced losses
    (``loss_dict``, ``sum / count`` per report key, real on the last pipeline stage only) are
    broadcast from the last rank (one small collective, every rank calls it), then combined with
    the step's plan (host totals and rollout-correction statistics). ``reduced``: ``{key: value}``
    as broadcast (NaN: not reported)."""
    keys = REPORT_KEYS + (("mtp_loss",) if mtp else ())
    values = torch.tensor([float(loss_dict[k]) if k in loss_dict else math.nan for k in keys],
                          dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.broadcast(values, src=dist.get_world_size() - 1)
    totals = plan.totals
    reduced = dict(zip(keys, values.tolist()))
    present = {k: (reduced[k], 1.0) for k in REPORT_KEYS if not math.isnan(reduced[k])}
    record = {"iteration": iteration, **report_values(present, totals.pg_weight),
              **correction_values(plan.correction_stats)}
    if mtp:  # as the trainer records it: [sum, count], the count being the step's D
        value = reduced["mtp_loss"]
        record["mtp_loss"] = [value * totals.valid_tokens, float(totals.valid_tokens)] if not math.isnan(value) \
            else [0.0, 0.0]
    record.update(weight=totals.pg_weight, valid_tokens=totals.valid_tokens)
    return record, reduced
