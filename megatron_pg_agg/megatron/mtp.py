"""Multi-token prediction (MTP) on the project's packed THD microbatches: the model side.

The contract (written once, in :mod:`megatron_pg_agg.patches.mtp_loss`): the MTP loss is a token
mean over the step's valid response tokens ``D``, ``dJ_mtp/dtheta = (f / K) sum_k sum_t d_k[t]
grad CE_k[t] / D``, whatever the policy-gradient mode. Here:

* :func:`mtp_block_spec`: megatron-core's MTP block spec for the project's layer spec (the local
  spec's THD attention travels into the MTP layer);
* :func:`return_main_logits`: GPTModel computes the MTP loss only when it is given ``labels``,
  and with ``labels`` it returns the main head's cross-entropy instead of its logits; the
  policy-gradient loss needs the vocabulary-parallel logits, so the model's main-head
  ``compute_language_model_loss`` call returns them instead (the MTP heads' calls are untouched);
* :func:`mtp_forward_kwargs`: what ``GPTModel.forward`` needs for MTP (the labels, and the step's
  denominator mask as its label-aligned ``loss_mask``);
* :func:`begin_mtp_step` and :func:`mtp_report_pair`: the per-step factor ``W / D`` and the
  ``mtp_loss`` report pair of each microbatch (over the step, ``[sum_k sum_t d_k CE_k / K, D]``:
  the mean over depths of each depth's token-mean cross-entropy).
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron.core.utils import get_attr_wrapped_model

from megatron_pg_agg.core.losses import StepTotals
from megatron_pg_agg.patches import mtp_loss

__all__ = [
    "MTP_REPORT_KEY", "begin_mtp_step", "mtp_block_spec", "mtp_forward_kwargs", "mtp_kwargs",
    "mtp_report_pair", "return_main_logits",
]

MTP_REPORT_KEY = "mtp_loss"
"""The report key of the MTP loss pair (with multi-token prediction only)."""

_MAIN_LABELS = "_megatron_pg_agg_main_labels"
"""GPTModel attribute: the ``labels`` tensor of the forward in flight (its main head's)."""


def mtp_block_spec(config, layer_spec, *, use_te: bool, vp_stage: Optional[int] = None):
    """megatron-core's MTP block spec for ``layer_spec`` (None on a stage that builds no MTP layer,
    or without ``config.mtp_num_layers``); arguments bound by name, as each release names them."""
    if not getattr(config, "mtp_num_layers", None):
        return None
    arguments = dict(config=config, spec=layer_spec, use_transformer_engine=use_te, vp_stage=vp_stage)
    accepted = inspect.signature(get_gpt_mtp_block_spec).parameters
    return get_gpt_mtp_block_spec(**{k: v for k, v in arguments.items() if k in accepted})


def return_main_logits(gpt) -> None:
    """Make ``gpt`` (a GPTModel with MTP) return its main head's logits ``[b, s, V/tp]`` when it
    is given ``labels``, exactly what it returns without them.

    GPTModel ends with ``loss = self.compute_language_model_loss(labels, logits)`` when labels are
    given; its MTP heads call the same method with rolled copies of the labels. The instance
    attribute set here answers the call whose labels are the forward's own (set by
    :func:`mtp_forward_kwargs`) with ``logits.transpose(0, 1)``, and every other call with
    upstream's cross-entropy."""
    original = gpt.compute_language_model_loss

    def compute_language_model_loss(labels, logits):
        if labels is not None and labels is getattr(gpt, _MAIN_LABELS, None):
            return logits.transpose(0, 1).contiguous()  # [s, b, V/tp] -> [b, s, V/tp]
        return original(labels, logits)

    gpt.compute_language_model_loss = compute_language_model_loss
    setattr(gpt, _MAIN_LABELS, None)


def mtp_forward_kwargs(model, mb) -> dict:
    """``GPTModel.forward`` keywords for MTP on microbatch ``mb``: its labels (next tokens) and
    its denominator mask as the label-aligned ``loss_mask`` (prompt tokens and padding are 0).
    ``model`` is a model chunk (DDP-wrapped or not) set up by :func:`return_main_logits`."""
    return mtp_kwargs(model, mb.labels, mb.denominator_mask.unsqueeze(0).float())


def mtp_kwargs(model, labels: torch.Tensor, loss_mask: torch.Tensor) -> dict:
    """``GPTModel.forward`` keywords for MTP: ``labels`` ``[b, s]`` (next tokens) and the
    label-aligned ``loss_mask`` ``[b, s]``; the model (set up by :func:`return_main_logits`) then
    returns the main head's logits for exactly these labels."""
    gpt = get_attr_wrapped_model(model, _MAIN_LABELS, return_model_obj=True)
    setattr(gpt, _MAIN_LABELS, labels)
    return {"labels": labels, "loss_mask": loss_mask}


def begin_mtp_step(totals: StepTotals) -> None:
    """Once per step, before the schedule, on every rank: the MTP factor ``W / D`` from the step's
    host integers, and the recorded sums and megatron-core's MTP tracker emptied."""
    mtp_loss.take_attached_sum()
    mtp_loss.set_mtp_loss_scale(totals.pg_weight, totals.valid_tokens)
    MTPLossLoggingHelper.tracker.clear()


def mtp_report_pair(mb, factor: float) -> torch.Tensor:
    """float64 ``[2]``: this microbatch's ``[sum_k sum_t d_k CE_k / K, sum_t d_t]``, from the MTP
    losses its forward attached (``(f / K) d_k CE_k``, recorded by the patch; divided by ``f`` =
    ``factor``). Called by the loss function right after the microbatch's forward, on the stage
    that holds the MTP block; summed over the step's microbatches and DP x CP like every report
    pair, its value is the mean over depths of each depth's token-mean cross-entropy."""
    total = mtp_loss.take_attached_sum(device=mb.denominator_mask.device) / factor
    # megatron-core's own MTP tracker is emptied: it holds per-microbatch means (sums under the
    # patch on 0.17+), not the token mean, and Megatron-LM's reduction of it uses ReduceOp.AVG,
    # which gloo lacks; this pair replaces it (Megatron-LM then logs no "mtp_k loss")
    MTPLossLoggingHelper.tracker.clear()
    return torch.stack([total, mb.denominator_mask.sum().double()])
