"""The loss-function provider for Megatron-core's forward-backward schedules.

Contract (the same in megatron-core 0.15 to 0.19, ``pipeline_parallel/schedules.py`` and
``distributed/finalize_model_grads.py``): with ``config.calculate_per_token_loss=True`` a loss_func
returning ``(loss, num_tokens, report)`` has its ``loss`` back-propagated unchanged and its integer
``num_tokens`` summed over microbatches; ``finalize_model_grads`` broadcasts that sum from the last
pipeline stage, all-reduces it over DP x CP and divides every gradient by it. Returning
``(sum_t c_t pg_t + ..., sum_t k_t, report)`` per microbatch (see :mod:`megatron_pg_agg.core.losses`)
therefore gives exactly ``J`` for every layout and microbatch split. Nothing is reduced over TP:
every TP rank computes the same loss and count. (From 0.18 ``finalize_model_grads`` divides by
``max(count, 1)`` instead of skipping a zero count; a step with ``W = 0`` has zero gradients
either way.)
"""
from __future__ import annotations

from functools import partial
from typing import Iterator, Optional

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from megatron_pg_agg.core.losses import (
    PGLossConfig,
    SequenceStatistic,
    StepTotals,
    pg_loss_sum,
    vocab_parallel_logprobs,
)
from megatron_pg_agg.data.planner import Microbatch

from .mtp import MTP_REPORT_KEY, mtp_forward_kwargs, mtp_report_pair


def packed_seq_params(mb: Microbatch):
    """THD PackedSeqParams of a microbatch (real and padded boundaries, as TE expects)."""
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=mb.cu_seqlens,
        cu_seqlens_kv=mb.cu_seqlens,
        cu_seqlens_q_padded=mb.cu_seqlens_padded,
        cu_seqlens_kv_padded=mb.cu_seqlens_padded,
        max_seqlen_q=mb.max_seqlen,
        max_seqlen_kv=mb.max_seqlen,
    )


def pg_loss_func(mb: Microbatch, loss_cfg: PGLossConfig, totals: StepTotals, tp_group, output_tensor,
                 cp_group=None, mtp_factor: Optional[float] = None):
    """Megatron loss_func: vocab-parallel logits ``[1, T, V/tp]`` -> ``(loss, count, report)``.

    ``cp_group``: the context-parallel group, over which gspo/gmpo complete their per-sequence
    statistic (one all-reduce per microbatch; unused by ppo/cispo). ``mtp_factor``: the model's
    ``mtp_loss_scaling_factor`` with multi-token prediction (the report then holds the
    microbatch's ``mtp_loss`` pair, :func:`.mtp.mtp_report_pair`), else None."""
    logits = output_tensor[0]
    logprobs, entropy = vocab_parallel_logprobs(
        logits, mb.labels[0], tp_group=tp_group, with_entropy=loss_cfg.needs_entropy
    )
    sequences = None
    if loss_cfg.needs_sequence_statistic:
        sequences = SequenceStatistic(mb.cu_seqlens_local, mb.seq_numerator_tokens, logprobs.numel(),
                                      cp_group=cp_group)
    loss, count, report = pg_loss_sum(logprobs, mb, totals, loss_cfg, entropy=entropy, sequences=sequences)
    if mtp_factor is not None:
        report[MTP_REPORT_KEY] = mtp_report_pair(mb, mtp_factor)
    return loss, count, report


def forward_microbatch(model, mb: Microbatch):
    """GPTModel (one pipeline chunk) on one packed THD microbatch: vocab-parallel logits
    ``[1, T, V/tp]`` on the last stage, the hidden state elsewhere (the input comes by p2p).
    With multi-token prediction the model also gets the labels and the denominator mask, from
    which its MTP block attaches the MTP loss (:mod:`.mtp`); it still returns the logits."""
    extra = mtp_forward_kwargs(model, mb) if get_model_config(model).mtp_num_layers else {}
    return model(
        input_ids=mb.tokens,
        position_ids=mb.position_ids,
        attention_mask=None,
        packed_seq_params=packed_seq_params(mb),
        **extra,
    )


def mtp_factor_of(model) -> Optional[float]:
    """The model's ``mtp_loss_scaling_factor`` with multi-token prediction, else None."""
    config = get_model_config(model)
    return float(config.mtp_loss_scaling_factor) if config.mtp_num_layers else None


def make_forward_step(loss_cfg: PGLossConfig, totals: StepTotals, *, tp_group=None, cp_group=None,
                      device=None):
    """A ``forward_step_func`` for ``get_forward_backward_func()`` running GPTModel on packed THD
    microbatches from the data iterator (one iterator of :class:`Microbatch` per model chunk)."""

    def forward_step(data_iterator: Iterator[Microbatch], model):
        mb = next(data_iterator)
        if device is not None:
            mb = mb.to(device)
        return forward_microbatch(model, mb), partial(pg_loss_func, mb, loss_cfg, totals, tp_group,
                                                      cp_group=cp_group, mtp_factor=mtp_factor_of(model))

    return forward_step


def run_schedule(model: list, microbatches: list, forward_step, *, forward_only: bool = False,
                 seq_length: Optional[int] = None):
    """megatron-core's forward-backward schedule over this rank's planned microbatches (one data
    iterator per model chunk with virtual pipeline stages); returns the loss reports of the last
    stage. ``seq_length`` (the pipeline's p2p buffer length) defaults to the longest
    :class:`Microbatch`. The one place the project calls ``get_forward_backward_func()``."""
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(microbatches) for _ in model] if len(model) > 1 else iter(microbatches),
        model=model, num_microbatches=len(microbatches),
        seq_length=seq_length if seq_length is not None else max(mb.num_tokens for mb in microbatches),
        micro_batch_size=1, forward_only=forward_only,
    )
