r"""The objective in verl's Megatron engine: step weights on the mini-batch, one loss per micro-batch.

verl's engine (``MegatronEngine.forward_backward_batch``, verl 0.9.1) receives one mini-batch per
optimizer step on each DP rank, cuts it into micro-batches (fixed size or dynamic, by tokens) and
calls ``loss_function(model_output, data, dp_group)`` on each. Whatever the layout, one
:class:`VerlPGLoss` does two things:

1. :meth:`VerlPGLoss.prepare_step`, on the whole mini-batch of this rank before verl splits it
   (the engine patch calls it; host tensors, nothing on the device): the step's token weights
   ``c_t`` over the mini-batch of ALL DP ranks (:func:`megatron_pg_agg.integrations.step_weights.
   dp_step_weights`, shared with the AReaL plug-in), with verl's ``uid`` as the prompt group; the rollout correction
   (:func:`megatron_pg_agg.core.rollout_correction.rollout_correction`) on the rank's own rows. The result
   travels per token, as fields of the batch laid out like ``response_mask`` (padded or jagged),
   so every micro-batch split carries its tokens' weights; ``W`` and ``D`` travel as non-tensor data.
2. :meth:`VerlPGLoss.__call__` on each micro-batch: :func:`megatron_pg_agg.core.losses.pg_loss_sum`
   on its tokens, returned as ``dp * loss_sum / W``.

Why ``dp * loss_sum / W`` is exactly J under verl's engine, in both of its regimes:

* without ``calculate_per_token_loss``: the engine multiplies by ``num_micro_batch`` and Megatron's
  schedule divides by it; DDP averages the gradients over the DP ranks: the gradient is
  ``(1/dp) sum_ranks sum_mb d(dp loss_sum_mb / W) = dJ``;
* with it: the engine returns ``(loss * R / dp, r_mb)`` with R the global routed tokens and
  ``r_mb`` a micro-batch's; Megatron does not divide, DDP sums, ``finalize_model_grads`` divides by
  ``sum r_mb = R``: again ``(1/dp) sum d(dp loss_sum_mb / W)``.

Micro-batch sizes, dynamic batching and the padded or jagged layout only cut the sum differently.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_pg_agg.core.aggregation import TokenWeights
from megatron_pg_agg.core.losses import LossPart, PGLossConfig, SequenceStatistic, StepTotals, pg_loss_sum
from megatron_pg_agg.core.modes import PROMPT_MEAN
from megatron_pg_agg.core.rollout_correction import rollout_correction

from .step_weights import dp_step_weights

COEF = "pg_agg_coef"
"""float32 per response token: c_t of the step (0 outside the numerator)."""
NUMERATOR = "pg_agg_numerator"
"""bool per response token: n_t (the valid tokens less those a rollout correction masked)."""
CORRECTION = "pg_agg_correction"
"""float32 per response token: the rollout-correction weight of pg_t (ours, or verl's rollout_is_weights)."""
PG_WEIGHT, VALID_TOKENS = "pg_agg_pg_weight", "pg_agg_valid_tokens"
"""Non-tensor: W and D of the whole mini-batch (all DP ranks)."""
GROUP_KEY = "uid"
"""verl's prompt-group key (one per sample, shared by the rollout.n samples of a prompt)."""
VERL_IS_WEIGHTS = "rollout_is_weights"
ROLLOUT_LOGPROBS = "rollout_log_probs"


class VerlBatchError(ValueError):
    """A mini-batch the configured objective cannot be computed on (names the field)."""


@dataclass
class _Rows:
    """A mini-batch's response fields flattened row after row (host tensors)."""

    lengths: torch.Tensor
    """int64 [B]: tokens per row (the padded width for padded rows)."""
    nested: bool

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.values() if tensor.is_nested else tensor.reshape(-1)

    def like(self, values: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
        """``values`` (flat) laid out as ``template`` (jagged with its offsets, or padded)."""
        if template.is_nested:
            return torch.nested.nested_tensor_from_jagged(values, offsets=template.offsets())
        return values.reshape(template.shape)


def _rows(response_mask: torch.Tensor) -> _Rows:
    if response_mask.is_nested:
        return _Rows(response_mask.offsets().diff().to(torch.int64), True)
    if response_mask.dim() != 2:
        raise VerlBatchError("response_mask must be [batch, response length] or jagged; got "
                             f"{tuple(response_mask.shape)}")
    return _Rows(torch.full((response_mask.shape[0],), response_mask.shape[1], dtype=torch.int64), False)


def _group_ids(data) -> list:
    if GROUP_KEY not in data.keys():
        raise VerlBatchError(f"prompt_mean needs verl's {GROUP_KEY!r} in the batch (the prompt key GRPO groups by); "
                             "the mini-batch has none")
    uids = data[GROUP_KEY]
    uids = uids.tolist() if hasattr(uids, "tolist") else list(uids)
    return [str(u) for u in uids]


class VerlPGLoss:
    """verl's ``loss_function(model_output, data, dp_group) -> (loss, metrics)`` for one
    :class:`PGLossConfig` (module docstring). Built once per worker by the plug-in."""

    def __init__(self, loss_cfg: PGLossConfig):
        self.loss_cfg = loss_cfg

    # -- 1. the whole mini-batch, before verl's micro-batch split --------------------------------
    def prepare_step(self, data, dp_group=None) -> None:
        """Add the step's per-token weights to ``data`` (this rank's mini-batch, host tensors)."""
        from verl.utils import tensordict_utils as tu  # noqa: PLC0415  (verl is optional)

        cfg = self.loss_cfg
        response_mask = data["response_mask"]
        rows = _rows(response_mask)
        mask = rows.flat(response_mask).to(torch.bool)
        numerator = mask
        weights = None
        has_verl_is = VERL_IS_WEIGHTS in data.keys()
        if cfg.rollout_correction is not None:
            if has_verl_is:
                raise VerlBatchError(f"{VERL_IS_WEIGHTS!r} (verl's algorithm.rollout_correction) and "
                                     f"actor_rollout_ref.pg_agg.rollout_correction={cfg.rollout_correction!r} "
                                     "would correct twice: turn one off")
            if ROLLOUT_LOGPROBS not in data.keys():
                raise VerlBatchError(f"actor_rollout_ref.pg_agg.rollout_correction needs {ROLLOUT_LOGPROBS!r} in "
                                     "the batch (the rollout engine's log-probs: "
                                     "actor_rollout_ref.rollout.calculate_log_probs=True)")
            correction = rollout_correction(mask, rows.flat(data["old_log_probs"]).float(),
                                            rows.flat(data[ROLLOUT_LOGPROBS]).float(), rows.lengths, cfg)
            numerator, weights = correction.numerator_mask, correction.weights
        elif has_verl_is:
            weights = rows.flat(data[VERL_IS_WEIGHTS]).float()
        group_ids = _group_ids(data) if cfg.mode == PROMPT_MEAN else None
        step = dp_step_weights(mask, numerator, rows.lengths, group_ids, mode=cfg.mode, divisor=cfg.divisor,
                               dp_group=dp_group)
        data[COEF] = rows.like(step.coef, response_mask)
        data[NUMERATOR] = rows.like(numerator, response_mask)
        if weights is not None:
            data[CORRECTION] = rows.like(weights, response_mask)
        tu.assign_non_tensor(data, **{PG_WEIGHT: step.pg_weight, VALID_TOKENS: step.valid_tokens})

    # -- 2. one micro-batch ------------------------------------------------------------------------
    def __call__(self, model_output, data, dp_group=None):
        from verl.utils.metric import AggregationType, Metric  # noqa: PLC0415
        from verl.workers.utils.padding import no_padding_2_padding  # noqa: PLC0415

        if COEF not in data.keys():
            raise VerlBatchError("the micro-batch has no step weights: VerlPGLoss.prepare_step did not run on its "
                                 "mini-batch (is the plug-in's engine patch applied? megatron_pg_agg.integrations."
                                 "verl_plugin.apply_verl_plugin)")
        cfg = self.loss_cfg
        logprobs = no_padding_2_padding(model_output["log_probs"], data)
        entropy = model_output.get("entropy", None)
        if entropy is not None:
            entropy = no_padding_2_padding(entropy, data)
        names = ["response_mask", "old_log_probs", "advantages", COEF, NUMERATOR]
        names += [n for n in (CORRECTION, "ref_log_prob") if n in data.keys()]
        fields = data.select(*names).to_padded_tensor()
        rows, width = logprobs.shape
        if fields["response_mask"].shape[-1] < width:  # jagged fields padded to this micro-batch's longest
            # response, the log-probs to verl's max_response_len: widen the fields (padding: masked)
            fields = fields.apply(lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1])))
        if cfg.kl_coef > 0 and "ref_log_prob" not in fields.keys():
            raise VerlBatchError("kl_coef > 0 (actor.use_kl_loss) needs 'ref_log_prob' in the batch")
        numerator = fields[NUMERATOR].to(torch.bool).reshape(-1)
        part = LossPart(
            old_logprobs=fields["old_log_probs"].float().reshape(-1),
            advantages=fields["advantages"].float().reshape(-1),
            numerator_mask=numerator,
            denominator_mask=fields["response_mask"].to(torch.bool).reshape(-1),
            # c_t alone: the step's W is known (non-tensor), so the per-token counts are not needed
            token_weights=TokenWeights(fields[COEF].float().reshape(-1),
                                       torch.zeros(rows * width, dtype=torch.int32, device=logprobs.device), cfg.mode),
            ref_logprobs=fields["ref_log_prob"].float().reshape(-1) if cfg.kl_coef > 0 else None,
            correction_weights=fields[CORRECTION].float().reshape(-1) if CORRECTION in fields.keys() else None,
        )
        sequences = None
        if cfg.needs_sequence_statistic:  # rows are whole responses: one segment per row
            cu = torch.arange(rows + 1, device=logprobs.device) * width
            sequences = SequenceStatistic(cu, numerator.reshape(rows, width).sum(-1), rows * width)
        pg_weight, valid = int(data[PG_WEIGHT]), int(data[VALID_TOKENS])
        loss_sum, _, report = pg_loss_sum(
            logprobs.reshape(-1), part, StepTotals(pg_weight, valid), cfg,
            entropy=None if entropy is None else entropy.reshape(-1), sequences=sequences)
        scale = 1.0 / max(pg_weight, 1)
        dp = int(data["dp_size"])
        metrics = {
            # J's and J_pg's share of this micro-batch (summed over micro-batches and DP ranks: J);
            # detached tensors, no host sync here
            "actor/pg_agg_objective": Metric(AggregationType.SUM, loss_sum.detach() * scale),
            "actor/pg_loss": Metric(AggregationType.SUM, report["pg_loss"][0] * scale),
        }
        return loss_sum * (dp * scale), metrics
