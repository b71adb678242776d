r"""NeMo-RL's own ``ClippedPGLossFn``, handed the plug-in's advantages: the loss object of the NeMo-RL plug-in.

:class:`PGAggLossFn` is what NeMo-RL's ``Policy.train`` ships to its Megatron workers (pickled) and
what ``LossPostProcessor`` calls per micro-batch (per sequence under ``SequencePackingLossWrapper``).
It holds a copy of the run's ``ClippedPGLossFn`` (``grpo.setup()``'s own object: every option it was
built with) and calls it on the same data with ``advantages * k_t``
(:data:`~megatron_pg_agg.integrations.nemo_rl.weights.ADVANTAGE_SCALE`, computed over the whole
optimizer step on the driver: :mod:`.weights`). NeMo-RL's maths is its own: the ratio,
clip, dual clip, CISPO, GSPO's sequence ratio, the importance-sampling correction and its
truncation/masking, the KL term and its token- or sequence-level reduction.

The two paths. NeMo-RL's ``train()`` hands every micro-batch the step's true counts (``G`` tokens,
``S`` sequences); its split path (``begin_train_step`` / ``train_microbatch`` /
``finish_train_step``) hands placeholders ``1`` and divides the summed gradient by ``G`` or ``S``
(by the loss's ``loss_type``) at the end. This loss reports ``loss_type`` TOKEN_LEVEL whatever
``loss_fn.token_level_loss`` says, so both paths divide by ``G`` (and the MoE aux and MTP terms,
which NeMo-RL normalises by ``1/global_valid_toks`` on ``train()``, get the same count on the split
path in every mode: the shape of NeMo-RL #3888/#3889). A sequence-level inner loss (GSPO; a
sequence-level KL) divides by ``global_valid_seqs``; it is handed ``S' = g S / G`` instead, with
``g`` the ``global_valid_toks`` NeMo-RL passed (``G`` on ``train()``: ``S' = S``; ``1`` on the split
path: ``S' = S/G``, and the final ``1/G`` makes it ``1/S``). Metrics normalised like the loss are
re-labelled TOKENS accordingly (``metric_normalizations``), so the split path's rescaled metrics
equal ``train()``'s.

VAPO's positive-example NLL (``loss_fn.positive_example_nll_weight``): NeMo-RL divides it by each
micro-batch's own count of correct tokens (its #3791); here the inner loss runs with the weight 0
and the term is NeMo-RL's ``masked_mean`` over the correct tokens with the step's count (the
driver's :data:`~megatron_pg_agg.integrations.nemo_rl.weights.NLL_SCALE`): a token mean over the
step's correct tokens on both paths.

No host sync is added to NeMo-RL's (its loss calls ``.item()`` for its metrics; the plug-in's own
arithmetic is per-token tensor work, plus one ``.item()`` for the NLL metric when that term is on).
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from megatron_pg_agg.integrations.nemo_rl.weights import (
    ADVANTAGE_SCALE,
    NLL_SCALE,
    STEP_SEQUENCES,
    STEP_TOKENS,
    NemoRLSettings,
)

__all__ = ["PGAggLossFn"]


def _with(data, **changes):
    """A shallow copy of a micro-batch's data (NeMo-RL's ``BatchedDataDict`` or the plain dict
    ``SequencePackingLossWrapper`` builds) with ``changes`` set; the caller's data is left as it was."""
    out = copy.copy(data)
    for key, value in changes.items():
        out[key] = value
    return out


class PGAggLossFn:
    """The run's ``ClippedPGLossFn`` training the project's objective (module docstring).

    Built on the driver by :func:`megatron_pg_agg.integrations.nemo_rl.plugin.use_pg_agg`; picklable
    (NeMo-RL sends it to its Ray workers, which must have megatron_pg_agg installed)."""

    def __init__(self, clipped_pg_loss, settings: NemoRLSettings):
        from nemo_rl.algorithms.loss.interfaces import LossType, MetricNormalizer  # noqa: PLC0415

        self.settings = settings
        self.inner = copy.copy(clipped_pg_loss)
        self.nll_weight = float(clipped_pg_loss.positive_example_nll_weight)
        self.inner.positive_example_nll_weight = 0.0  # the term is made over the step here
        self.sequence_level = clipped_pg_loss.loss_type == LossType.SEQUENCE_LEVEL
        # what NeMo-RL's code reads off a loss object
        self.loss_type = LossType.TOKEN_LEVEL
        self.input_type = clipped_pg_loss.input_type
        self.use_fused_linear_logprobs = clipped_pg_loss.use_fused_linear_logprobs
        self.reference_policy_kl_penalty = clipped_pg_loss.reference_policy_kl_penalty
        relabel = {MetricNormalizer.SEQUENCES} if self.sequence_level else set()
        self.metric_normalizations = {
            name: MetricNormalizer.TOKENS if name in ("loss", "kl_penalty", "positive_nll_loss") or norm in relabel
            else norm for name, norm in clipped_pg_loss.metric_normalizations.items()}

    def __call__(self, next_token_logprobs: torch.Tensor, data, global_valid_seqs: torch.Tensor,
                 global_valid_toks: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        if ADVANTAGE_SCALE not in data:
            raise KeyError(f"the micro-batch has no {ADVANTAGE_SCALE!r}: PGAggLossFn needs the batch that the "
                           "plug-in's Policy.train prepared (megatron_pg_agg.integrations.nemo_rl.plugin.use_pg_agg)")
        scaled = _with(data, advantages=data["advantages"] * data[ADVANTAGE_SCALE].to(data["advantages"].dtype))
        seqs = global_valid_seqs
        if self.sequence_level:  # S' = g S / G (module docstring); G = 0 only on a step with nothing to train
            step_seqs, step_toks = data[STEP_SEQUENCES][0], data[STEP_TOKENS][0]
            seqs = global_valid_toks * step_seqs / step_toks.clamp(min=1.0)
        loss, metrics = self.inner(next_token_logprobs, scaled, seqs, global_valid_toks)
        if self.nll_weight > 0 and "rewards" in data:
            from nemo_rl.algorithms.utils import masked_mean  # noqa: PLC0415

            mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
            weights = mask * data[NLL_SCALE][:, 1:].to(mask.dtype)
            nll = masked_mean(-next_token_logprobs, weights, global_normalization_factor=global_valid_toks)
            loss = loss + self.nll_weight * nll
            metrics = {**metrics, "positive_nll_loss": float(nll.detach())}
        return loss, metrics
