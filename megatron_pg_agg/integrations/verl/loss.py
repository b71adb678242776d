r"""The objective in verl's Megatron engine: step weights on the mini-batch, one loss per micro-batch.

verl's engine (``MegatronEngine.forward_backward_batch``, verl 0.9.1) receives one mini-batch per
optimizer step on each DP rank, cuts it into micro-batches (fixed size or dynamic, by tokens) and
calls ``loss_function(model_output, data, dp_group)`` on each. Whatever the layout, one
:class:`VerlPGLoss` (the actor's; the critic's :class:`VerlValueLoss` the same way, with the value
term's mode and verl's value loss, no rollout correction) does two things:

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
from typing import Optional

import torch

from megatron_pg_agg.core.aggregation import TokenWeights
from megatron_pg_agg.core.losses import LossPart, PGLossConfig, SequenceStatistic, StepTotals, pg_loss_sum
from megatron_pg_agg.core.modes import PROMPT_MEAN
from megatron_pg_agg.core.rollout_correction import rollout_correction
from megatron_pg_agg.core.value import ValueLossConfig, value_loss_sum
from megatron_pg_agg.integrations.step_weights import dp_step_weights

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


class VerlStepLoss:
    """What the plug-in's verl losses share (the policy's :class:`VerlPGLoss`, the critic's
    :class:`VerlValueLoss`): the step weights of the term's mode on the whole mini-batch
    (:meth:`prepare_step`, run by the engine patch before verl splits it), and the micro-batch's
    fields padded to the width of the model's output. The engine patch recognises this class."""

    mode: str
    divisor: Optional[float]

    def _numerator(self, data, rows: _Rows, mask: torch.Tensor):
        """``(n_t, per-token weight or None)`` of this rank's tokens: the valid tokens by default."""
        return mask, None

    # -- 1. the whole mini-batch, before verl's micro-batch split --------------------------------
    def prepare_step(self, data, dp_group=None) -> None:
        """Add the step's per-token weights to ``data`` (this rank's mini-batch, host tensors)."""
        from verl.utils import tensordict_utils as tu  # noqa: PLC0415  (verl is optional)

        response_mask = data["response_mask"]
        rows = _rows(response_mask)
        mask = rows.flat(response_mask).to(torch.bool)
        numerator, weights = self._numerator(data, rows, mask)
        group_ids = _group_ids(data) if self.mode == PROMPT_MEAN else None
        step = dp_step_weights(mask, numerator, rows.lengths, group_ids, mode=self.mode, divisor=self.divisor,
                               dp_group=dp_group)
        data[COEF] = rows.like(step.coef, response_mask)
        data[NUMERATOR] = rows.like(numerator, response_mask)
        if weights is not None:
            data[CORRECTION] = rows.like(weights, response_mask)
        tu.assign_non_tensor(data, **{PG_WEIGHT: step.pg_weight, VALID_TOKENS: step.valid_tokens})

    @staticmethod
    def _fields(data, names: list, width: int):
        """The micro-batch's ``names`` as padded ``[rows, width]`` tensors (a TensorDict)."""
        if COEF not in data.keys():
            raise VerlBatchError("the micro-batch has no step weights: prepare_step did not run on its mini-batch "
                                 "(is the plug-in's engine patch applied? megatron_pg_agg.integrations."
                                 "verl.plugin.apply_verl_plugin)")
        fields = data.select(*names).to_padded_tensor()
        if fields["response_mask"].shape[-1] < width:  # jagged fields padded to this micro-batch's longest
            # response, the model's output to verl's max_response_len: widen the fields (padding: masked)
            fields = fields.apply(lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1])))
        return fields

    @staticmethod
    def _step_totals(data) -> tuple:
        """``(W, D, dp)``: the step's weight and valid tokens (all DP ranks), and verl's DP size."""
        return int(data[PG_WEIGHT]), int(data[VALID_TOKENS]), int(data["dp_size"])


class VerlPGLoss(VerlStepLoss):
    """verl's ``loss_function(model_output, data, dp_group) -> (loss, metrics)`` for one
    :class:`PGLossConfig` (module docstring). Built once per worker by the plug-in."""

    def __init__(self, loss_cfg: PGLossConfig):
        self.loss_cfg = loss_cfg
        self.mode, self.divisor = loss_cfg.mode, loss_cfg.divisor

    def _numerator(self, data, rows: _Rows, mask: torch.Tensor):
        """The rollout correction's numerator and weights (ours, or verl's rollout_is_weights)."""
        cfg = self.loss_cfg
        has_verl_is = VERL_IS_WEIGHTS in data.keys()
        if cfg.rollout_correction is None:
            return mask, (rows.flat(data[VERL_IS_WEIGHTS]).float() if has_verl_is else None)
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
        return correction.numerator_mask, correction.weights

    # -- 2. one micro-batch ------------------------------------------------------------------------
    def __call__(self, model_output, data, dp_group=None):
        from verl.utils.metric import AggregationType, Metric  # noqa: PLC0415
        from verl.workers.utils.padding import no_padding_2_padding  # noqa: PLC0415

        cfg = self.loss_cfg
        logprobs = no_padding_2_padding(model_output["log_probs"], data)
        entropy = model_output.get("entropy", None)
        if entropy is not None:
            entropy = no_padding_2_padding(entropy, data)
        names = ["response_mask", "old_log_probs", "advantages", COEF, NUMERATOR]
        names += [n for n in (CORRECTION, "ref_log_prob") if n in data.keys()]
        rows, width = logprobs.shape
        fields = self._fields(data, names, width)
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
        pg_weight, valid, dp = self._step_totals(data)
        loss_sum, _, report = pg_loss_sum(
            logprobs.reshape(-1), part, StepTotals(pg_weight, valid), cfg,
            entropy=None if entropy is None else entropy.reshape(-1), sequences=sequences)
        scale = 1.0 / max(pg_weight, 1)
        metrics = {
            # J's and J_pg's share of this micro-batch x dp, as verl's own pg_loss: verl sums a SUM
            # metric over micro-batches and averages it over DP ranks (Metric.aggregate_dp), so the
            # logged value is J (J / dp without the factor); detached tensors, no host sync here
            "actor/pg_agg_objective": Metric(AggregationType.SUM, loss_sum.detach() * (dp * scale)),
            "actor/pg_loss": Metric(AggregationType.SUM, report["pg_loss"][0] * (dp * scale)),
        }
        return loss_sum * (dp * scale), metrics


class VerlValueLoss(VerlStepLoss):
    r"""The critic's loss in verl's contract (``loss_function(model_output, data, dp_group) ->
    (loss, metrics)``) for one :class:`~megatron_pg_agg.core.value.ValueLossConfig`: the value term
    ``J_v = sum_t c^v_t v_t / W^v`` of the value mode (the README's contract), with verl's per-token
    value loss ``v_t = 0.5 max((V - R)^2, (clip(V, V_old +- eps) - R)^2)``
    (:func:`megatron_pg_agg.core.value.value_token_losses`; verl applies its 0.5 after aggregating,
    the same number). Set on verl's critic worker by the plug-in in place of verl's ``value_loss``.

    The step weights come from :meth:`VerlStepLoss.prepare_step` on the whole mini-batch (groups:
    verl's ``uid``); each micro-batch returns ``dp * sum c^v v / W^v``, exact under verl's engine
    for the reasons of the module docstring (the critic runs the same ``forward_backward_batch``).
    The fields are verl's: ``values`` (V_old, the critic's own values before the update),
    ``returns`` and ``response_mask``; ``V`` is the value head's output at the token before each
    response token, sliced as verl's ``value_loss`` does (``no_padding_2_padding``)."""

    def __init__(self, value_cfg: ValueLossConfig):
        if value_cfg.mode is None:
            raise ValueError("VerlValueLoss needs the value term's mode (ValueLossConfig.with_policy_mode)")
        self.value_cfg = value_cfg
        self.mode, self.divisor = value_cfg.mode, value_cfg.divisor

    def __call__(self, model_output, data, dp_group=None):
        from verl.utils.metric import AggregationType, Metric  # noqa: PLC0415
        from verl.workers.utils.padding import no_padding_2_padding  # noqa: PLC0415

        cfg = self.value_cfg
        vpreds = no_padding_2_padding(model_output["values"], data)  # [rows, width]
        rows, width = vpreds.shape
        fields = self._fields(data, ["response_mask", "values", "returns", COEF, NUMERATOR], width)
        numerator = fields[NUMERATOR].to(torch.bool).reshape(-1)
        # c^v_t alone: the step's W^v is known (non-tensor), so the per-token counts are not needed
        weights = TokenWeights(fields[COEF].float().reshape(-1),
                               torch.zeros(rows * width, dtype=torch.int32, device=vpreds.device), cfg.mode)
        loss_sum, _, report = value_loss_sum(vpreds.reshape(-1), fields["values"].reshape(-1),
                                             fields["returns"].reshape(-1), numerator, weights, cfg)
        value_weight, valid, dp = self._step_totals(data)
        scale = dp / max(value_weight, 1)
        per_token = dp / max(valid, 1)
        masked_values = torch.where(numerator, vpreds.detach().reshape(-1).float(), 0.0).sum()
        metrics = {
            # this micro-batch's share x dp: verl sums over micro-batches and averages over DP ranks,
            # so the logged value is J_v, the clip fraction and mean V over the step's valid tokens
            # (verl's own keys; detached tensors, no host sync here)
            "critic/vf_loss": Metric(AggregationType.SUM, loss_sum.detach() * scale),
            "critic/vf_clipfrac": Metric(AggregationType.SUM, report["value_clip_fraction"][0] * per_token),
            "critic/vpred_mean": Metric(AggregationType.SUM, masked_values * per_token),
        }
        return loss_sum * scale, metrics
