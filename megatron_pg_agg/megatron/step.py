"""The step runner: one planned optimizer step's forward and backward through megatron-core.

Every loop in the project runs a step the same way, so it is written once here: zero the
gradient buffers, set the MoE routers' per-step factor, run the forward-backward schedule with the
per-token loss function, and reduce the step's ``[sum, count]`` report pairs. The optimizer step,
the finiteness check and the metrics record stay with the caller (the trainer's ``train_step``),
as torchtitan keeps ``forward_backward_step`` apart from ``train_step``.

After :func:`run_pg_step` every parameter's ``main_grad`` holds ``dJ/dtheta`` of the step (once
megatron's ``finalize_model_grads`` has divided by the all-reduced weight ``W``), and
:attr:`StepResult.pairs` the report pairs summed over the step's microbatches and DP x CP: for
each key of :data:`~megatron_pg_agg.core.losses.REPORT_KEYS`, ``sum / count`` is the step's value
(``objective`` is ``J``). No host sync happens here; :meth:`StepResult.values` is the one, after
the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from megatron_pg_agg.core.losses import REPORT_KEYS, PGLossConfig, report_values
from megatron_pg_agg.data.planner import StepPlan

from .loss_func import make_forward_step, run_schedule
from .moe import begin_moe_step, router_loss_pairs
from .mtp import MTP_REPORT_KEY, begin_mtp_step

__all__ = ["StepGroups", "StepResult", "run_pg_step"]


@dataclass(frozen=True)
class StepGroups:
    """The process groups one step uses, passed explicitly (None: that reduction is skipped)."""

    tensor: Optional[dist.ProcessGroup]
    """Tensor-parallel group: the vocabulary-parallel log-softmax."""
    context: Optional[dist.ProcessGroup]
    """Context-parallel group: gspo/gmpo's per-sequence statistic spans the CP shards of a sequence."""
    data_context: Optional[dist.ProcessGroup]
    """DP x CP group: the report pairs are summed over it (Megatron's weight all-reduce group)."""
    pipeline: Optional[dist.ProcessGroup]
    """Pipeline group: the last stage shares the report pairs with the other stages."""
    pipeline_last_rank: int
    """Global rank of this pipeline's last stage (the source of the report pairs)."""
    is_last_stage: bool
    """Whether this rank is on the last pipeline stage (the one whose loss reports are real)."""

    @staticmethod
    def from_parallel_state() -> "StepGroups":
        """The groups megatron-core's ``parallel_state`` set up for this rank."""
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        return StepGroups(
            tensor=parallel_state.get_tensor_model_parallel_group(),
            context=parallel_state.get_context_parallel_group(),
            data_context=parallel_state.get_data_parallel_group(with_context_parallel=True),
            pipeline=parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None,
            pipeline_last_rank=parallel_state.get_pipeline_model_parallel_last_rank(),
            is_last_stage=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        )


@dataclass(frozen=True)
class StepResult:
    """What one step's forward-backward reports, reduced over the whole step."""

    pairs: torch.Tensor
    """float64 ``[len(REPORT_KEYS), 2]`` (one more row with MTP): ``[sum, count]`` of each report
    key over the step's microbatches and DP x CP, on every pipeline stage (shared from the last
    one)."""
    router_pairs: Optional[torch.Tensor]
    """MoE: float64 ``[4, 2]`` router aux/z-loss ``[sum, count]`` pairs summed over the world
    (:func:`~megatron_pg_agg.megatron.moe.router_loss_pairs`); None without experts."""
    mtp: bool = False
    """Multi-token prediction: ``pairs`` has one more row, the ``mtp_loss`` pair
    (:func:`~megatron_pg_agg.megatron.mtp.mtp_report_pair`)."""

    def values(self, pg_weight: int) -> dict:
        """``{report key: sum / count}`` (None for a key not computed), with ``objective = 0`` on
        a ``W = 0`` step, and with MTP ``mtp_loss`` as its ``[sum, count]`` pair (as the MoE
        router losses are recorded). One host sync."""
        sums = self.pairs.cpu().tolist()
        values = report_values({name: sums[i] for i, name in enumerate(REPORT_KEYS)}, pg_weight)
        if self.mtp:
            values[MTP_REPORT_KEY] = sums[len(REPORT_KEYS)]
        return values


def run_pg_step(
    model: list,
    plan: StepPlan,
    loss_cfg: PGLossConfig,
    groups: StepGroups,
    *,
    dp_rank: int,
    experts: bool = False,
    device: Optional[torch.device] = None,
    microbatches: Optional[list] = None,
    forward_step: Optional[Callable] = None,
) -> StepResult:
    """Forward and backward of one planned step on this rank's model chunks.

    ``model``: megatron-core DDP chunks (one per virtual pipeline stage); ``plan``: the step, from
    :func:`~megatron_pg_agg.data.planner.plan_step`; ``dp_rank``: this rank's DP index (its
    microbatches are ``plan.for_rank(dp_rank)``); ``experts``: the model has MoE routers (their
    per-step factor ``W / M_total`` is set, and their loss pairs are reduced over the world);
    ``device``: where the microbatches go (None: they stay on the host, as on CPU).
    ``microbatches`` and ``forward_step`` replace the planned microbatches and the default
    forward step (the parity suite's controls and the benchmarks' baseline use them).
    """
    mbs = plan.for_rank(dp_rank) if microbatches is None else microbatches
    for chunk in model:
        chunk.zero_grad_buffer()
    if experts:  # the router losses' per-step factor (host integers, no collective)
        begin_moe_step(plan.totals.pg_weight, len(mbs), len(plan.microbatches))
    mtp = bool(get_model_config(model[0]).mtp_num_layers)
    if mtp:  # the MTP loss's per-step factor W / D (host integers)
        begin_mtp_step(plan.totals)
    if forward_step is None:
        forward_step = make_forward_step(loss_cfg, plan.totals, tp_group=groups.tensor,
                                         cp_group=groups.context, device=device)
    store = run_schedule(model, mbs, forward_step)
    # step-level reductions, never per microbatch
    keys = REPORT_KEYS + ((MTP_REPORT_KEY,) if mtp else ())
    pairs = torch.zeros(len(keys), 2, dtype=torch.float64, device=device)
    if groups.is_last_stage:
        for report in store:
            for i, name in enumerate(keys):
                if name in report:
                    pairs[i] += report[name].double()
    dist.all_reduce(pairs, group=groups.data_context)
    if groups.pipeline is not None:
        dist.broadcast(pairs, src=groups.pipeline_last_rank, group=groups.pipeline)
    router_pairs = None
    if experts:
        router_pairs = router_loss_pairs(model, len(mbs), device=device)
        dist.all_reduce(router_pairs)
    return StepResult(pairs=pairs, router_pairs=router_pairs, mtp=mtp)
