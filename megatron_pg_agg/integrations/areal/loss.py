r"""The objective in AReaL's Megatron engine: step weights before AReaL's splits, AReaL's own loss.

AReaL 1.0.4's actor (``PPOActor._ppo_update``) cuts the rank's batch into ``ppo_n_minibatches``
optimizer steps and hands each to ``engine.train_batch(mb, loss_fn, loss_weight_fn)``, which cuts
it again into micro-batches (``mb_spec``: ``n_mbs``, ``max_tokens_per_mb``, the packing algorithm)
and back-propagates, per micro-batch ``i`` of every DP rank,

    L_i * w_i / W_areal,       w_i = loss_weight_fn(mb_i) = valid tokens of mb_i,   W_areal = sum_i w_i,

with ``L_i = loss_fn(mb_i)`` = AReaL's ``grpo_loss_fn``: a token mean ``sum_t pg_t(A_t) / n_i``
over the micro-batch's loss mask (``n_i``: its count, or 1). Every policy loss AReaL offers (PPO
clip, dual clip, the decoupled/proximal form, rejection sampling, SAPO, GSPO) is positively
homogeneous in the advantage: ``pg_t(k A) = k pg_t(A)`` for ``k > 0`` constant over a sequence.
So the plug-in keeps AReaL's weight and AReaL's loss, and hands the loss

    A'_t = A_t * k_t,          k_t = c_t * (D / W) * n_i / w_i,

with ``c_t`` and ``W`` the step's token weights (:func:`megatron_pg_agg.integrations.step_weights.
dp_step_weights`, the same call as every other entry) and ``D = W_areal`` the step's valid tokens.
Then ``sum_i L_i w_i / W_areal = (1/W) sum_t c_t pg_t = J`` exactly, whatever the micro-batch
split. ``c_t * D / W`` travels per token (:data:`COEF`, shaped like ``loss_mask``), so AReaL's
splitting and packing carry it with its token; ``n_i / w_i`` is read from the micro-batch itself.

The numerator: the loss mask hands ``grpo_loss_fn`` the step's numerator (:data:`NUMERATOR`), the
weight counts the original mask (the filtered-numerator rule). With M2PO (``actor.m2_threshold``)
the numerator is chosen once over the whole step of every DP rank with AReaL's own
``_apply_m2po_masking`` (:func:`step_m2po_numerator`), and ``grpo_loss_fn`` is called with
``m2_threshold=None``, so it does not choose again per micro-batch (AReaL issue #1730).

Prompt groups: AReaL's ``ppo_update`` receives one dict per prompt group (its grouped rollout
workflow's record, ragged sizes allowed). :func:`tag_groups` marks every token with its group's
index, and :func:`whole_group_minibatches` cuts the optimizer steps along groups.

Distillation (AReaL's ``teacher_logp``, with ``rl_loss_weight`` and ``distill_loss_weight`` from its
``teacher`` keys): a term of its own, AReaL's token mean over the step's valid tokens (the
denominator mask ``d_t``, every DP rank) whatever the policy's mode, like the project's KL term:

    J = rl_loss_weight * J_pg + distill_loss_weight * (1/D) sum_t d_t kd_t

(``kd_t = logp_t - teacher_t``; with ``rl_loss_weight == 0``, AReaL's pure KD, J is the KD term alone,
``kd_t = -exp(logp_t - old_t) * (teacher_t - sg(logp_t))``). ``grpo_loss_fn`` divides its KD term by the
micro-batch's loss-mask count, which is exact (``sum_i (sum d kd / w_i) w_i / D``) only when that
mask is the original one; the PG term needs the step's numerator there (M2PO). So the joint loss
calls AReaL's ``grpo_loss_fn`` twice: the PG term on the scaled advantages and the numerator (its KD
weight set to 0: AReaL's statistics, ``rkl_loss`` included, are logged as before), and the KD term
on zero advantages (their PG term is exactly 0) and the original mask (its statistics discarded).
The pure KD loss is AReaL's own call on the original mask.

The critic (AReaL's ``PPOCritic._ppo_update``, the same ``train_batch`` and weight): AReaL's value
loss has no input it is homogeneous in, so :func:`exact_value_loss_fn` returns its own micro-batch
sum ``sum_t COEF_t v_t / w_i`` with ``v_t`` AReaL's clipped squared error (:func:`megatron_pg_agg.core.
value.value_token_losses`, factor 0.5, AReaL's ``critic.eps_clip``) on AReaL's tensors; the engine's
``sum_i L_i w_i / W_areal`` is then ``J_v = (1/W^v) sum_t c^v_t v_t`` in the value term's mode.

Host tensors, once per optimizer step; per micro-batch only tensor arithmetic (no host sync added).
"""
from __future__ import annotations

import contextlib
import heapq
from typing import Any, Callable, Optional

import torch

from megatron_pg_agg.core.modes import PROMPT_MEAN
from megatron_pg_agg.core.value import ValueLossConfig, value_token_losses
from megatron_pg_agg.integrations.step_weights import dp_step_weights, gather_over_dp

__all__ = ["GROUP", "COEF", "NUMERATOR", "ArealBatchError", "tag_groups", "whole_group_minibatches", "take_rows",
           "prepare_step", "step_m2po_numerator", "exact_loss_fn", "exact_value_loss_fn", "value_clip_eps",
           "ResponseGroupBaseline"]

GROUP = "pg_agg_group"
"""int64 per token: the index of the row's prompt group in this rank's ``ppo_update`` list."""
COEF = "pg_agg_coef"
"""float32 per token: ``c_t * D / W`` of the step (0 outside the numerator)."""
NUMERATOR = "pg_agg_numerator"
"""bool per token: the step's numerator (the loss mask, less M2PO's selection)."""


class ArealBatchError(ValueError):
    """A batch or setting the configured objective cannot be computed on (names the AReaL key)."""


def tag_groups(data: list) -> list:
    """AReaL's per-group records (``ppo_update``'s list, one dict per prompt group), each with
    :data:`GROUP` per token. Token-shaped on purpose: AReaL's splitters copy any other shape whole
    into every micro-batch. New dicts; AReaL's are left as they were."""
    return [{**d, GROUP: torch.full_like(d["attention_mask"], i, dtype=torch.int64)} for i, d in enumerate(data)]


def whole_group_minibatches(data: dict, n: int, key: str = "actor.ppo_n_minibatches") -> list:
    """Row indices of ``n`` optimizer steps that hold whole prompt groups, balanced by tokens
    (longest-processing-time first; ties by group order, so every rank cuts alike): AReaL's own
    split is by sequence and spreads a group over several steps. ``key``: AReaL's key that set
    ``n`` (``critic.ppo_n_minibatches`` for the critic), named in the refusal."""
    groups = data[GROUP][:, 0].tolist()
    tokens = data["attention_mask"].sum(1).tolist()
    members: dict = {}
    for row, group in enumerate(groups):
        members.setdefault(group, []).append(row)
    if n > len(members):
        raise ArealBatchError(
            f"{key}={n} optimizer steps cannot each hold whole prompt groups: this rank has "
            f"{len(members)} group(s); lower {key}, or give each DP rank more prompts "
            f"(train_dataset.batch_size)")
    totals = sorted(((-sum(tokens[r] for r in rows), order, group) for order, (group, rows) in
                     enumerate(members.items())))
    bins = [(0, b, []) for b in range(n)]
    heapq.heapify(bins)
    for _, _, group in totals:
        load, b, assigned = heapq.heappop(bins)
        assigned.extend(members[group])
        heapq.heappush(bins, (load + sum(tokens[r] for r in members[group]), b, assigned))
    return [sorted(assigned) for _, _, assigned in sorted(bins, key=lambda x: x[1])]


def take_rows(data: dict, rows: list) -> dict:
    """The rows ``rows`` of a padded AReaL batch: tensors shaped ``[batch, ...]`` are indexed,
    everything else is copied (as AReaL's own splitter does)."""
    batch = data["attention_mask"].shape[0]
    index = torch.tensor(rows, dtype=torch.long)
    return {k: (v.index_select(0, index.to(v.device)) if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == batch
                else v) for k, v in data.items()}


def step_m2po_numerator(old_logp: torch.Tensor, prox_logp: torch.Tensor, mask: torch.Tensor, threshold: float,
                        dp_group=None) -> torch.Tensor:
    """M2PO's token selection made once over the step of every DP rank: AReaL's own
    ``_apply_m2po_masking`` on every rank's valid tokens laid end to end (rank order), this
    rank's part returned as a mask shaped like ``mask``."""
    from areal.trainer.ppo.actor import _apply_m2po_masking  # noqa: PLC0415  (AReaL is optional)

    flat = mask.reshape(-1).bool()
    mine = (old_logp.reshape(-1)[flat].float().cpu(), prox_logp.reshape(-1)[flat].float().cpu())
    gathered, rank = gather_over_dp(mine, dp_group)
    old_all = torch.cat([g[0] for g in gathered])
    prox_all = torch.cat([g[1] for g in gathered])
    keep = _apply_m2po_masking(old_all, prox_all, torch.ones_like(old_all, dtype=torch.bool), threshold)
    start = sum(g[0].numel() for g in gathered[:rank])
    numerator = torch.zeros_like(flat)
    numerator[flat] = keep[start:start + mine[0].numel()].to(flat.device)
    return numerator.reshape(mask.shape)


def prepare_step(batch: dict, *, mode: str, divisor: Optional[float], m2_threshold: Optional[float] = None,
                 dp_group=None) -> dict:
    """One optimizer step's batch of this rank (padded, before ``train_batch`` splits it) with
    :data:`COEF` and :data:`NUMERATOR` added. Collective over ``dp_group``: every rank calls it for
    the same step. The critic's steps too (``mode``/``divisor`` the value term's, no M2PO). AReaL's
    distillation term (``teacher_logp``) needs nothing here: its token mean is over the original
    mask, which the micro-batch weight already counts (:func:`exact_loss_fn`)."""
    mask = batch["loss_mask"].bool()
    rows, width = mask.shape
    numerator = mask
    if m2_threshold is not None:
        prox = batch.get("prox_logp")
        if prox is None:
            raise ArealBatchError("actor.m2_threshold needs the proximal log-probs before the step (prox_logp in the "
                                  "batch: actor.prox_logp_method=recompute or metrics); an approximation from the "
                                  "current log-probs cannot be selected once per step")
        numerator = step_m2po_numerator(batch["logprobs"], prox, mask, m2_threshold, dp_group) & mask
    group_ids = None
    if mode == PROMPT_MEAN:
        if GROUP not in batch:
            raise ArealBatchError(f"prompt_mean needs the prompt groups ({GROUP!r}, set by the plug-in's ppo_update)")
        rank = torch.distributed.get_rank(dp_group) if dp_group is not None else 0
        group_ids = [(rank, g) for g in batch[GROUP][:, 0].tolist()]  # groups never span DP ranks in AReaL
    step = dp_step_weights(mask.reshape(-1).cpu(), numerator.reshape(-1).cpu(),
                           torch.full((rows,), width, dtype=torch.int64), group_ids, mode=mode, divisor=divisor,
                           dp_group=dp_group)
    scale = step.valid_tokens / step.pg_weight if step.pg_weight else 0.0
    coef = (step.coef * scale).to(torch.float32).reshape(rows, width).to(mask.device)
    return {**batch, COEF: coef, NUMERATOR: numerator}


def exact_loss_fn(loss_fn: Callable) -> Callable:
    """AReaL's micro-batch loss (``functools.partial(grpo_loss_fn, ...)``) on the advantages
    scaled by ``k_t`` (module docstring), the step's numerator as its loss mask, and M2PO off (the
    step chose it); with AReaL's distillation term (``teacher_logp``) that term on its own, a token
    mean over the original mask (module docstring). AReaL's engine calls it only on a micro-batch
    whose weight ``w_i`` is not 0."""

    def loss(logprobs: torch.Tensor, entropy: torch.Tensor, input_data: dict, **kwargs: Any) -> torch.Tensor:
        kwargs = {**kwargs, "m2_threshold": None}
        distilled = input_data.get("teacher_logp") is not None
        if distilled and float(input_data.get("rl_loss_weight", 1.0)) == 0:
            # AReaL's pure KD discards the PG term: its own token mean over the original mask (w_i tokens)
            return loss_fn(logprobs, entropy, input_data, **kwargs)
        weight = input_data["loss_mask"].bool().sum()  # w_i, as AReaL's loss_weight_fn counts it
        numerator = input_data[NUMERATOR].bool()
        count = numerator.sum().clamp(min=1)  # n_i, as ppo_actor_loss_fn divides by it
        k = input_data[COEF] * (count / weight)
        scaled = {**input_data, "advantages": input_data["advantages"] * k, "loss_mask": numerator}
        if not distilled:
            return loss_fn(logprobs, entropy, scaled, **kwargs)
        policy = loss_fn(logprobs, entropy, {**scaled, "distill_loss_weight": 0.0}, **kwargs)
        with _statistics_discarded():  # AReaL's own KD term; its statistics were logged by the call above
            distill = loss_fn(logprobs, entropy, {**input_data, "advantages": torch.zeros_like(
                input_data["advantages"])}, **kwargs)
        return policy + distill

    loss.__wrapped__ = loss_fn
    return loss


@contextlib.contextmanager
def _statistics_discarded():
    """AReaL's module-level statistics calls (``areal.utils.stats_tracker.stat`` / ``denominator`` /
    ``scalar``, looked up at each call) sent to a scratch tracker: a second loss call on the same
    micro-batch would otherwise log every statistic twice (and misalign AReaL's denominator lists)."""
    from areal.utils import stats_tracker  # noqa: PLC0415  (AReaL is optional)

    scratch = stats_tracker.DistributedStatsTracker()
    names = ("stat", "denominator", "scalar")
    saved = {name: getattr(stats_tracker, name) for name in names}
    for name in names:
        setattr(stats_tracker, name, getattr(scratch, name))
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(stats_tracker, name, function)


def value_clip_eps(loss_fn: Callable) -> float:
    """AReaL's ``critic.eps_clip`` as its ``PPOCritic._ppo_update`` hands it to ``train_batch``
    (``functools.partial(ppo_loss_fn, eps_clip=...)``); raises :class:`ArealBatchError` when the
    loss is not that partial (an AReaL release that changed the call)."""
    keywords = getattr(loss_fn, "keywords", None) or {}
    if "eps_clip" not in keywords:
        raise ArealBatchError("the critic's loss is not AReaL 1.0's functools.partial(ppo_loss_fn, eps_clip=...): "
                              "the plug-in cannot read critic.eps_clip from it")
    return float(keywords["eps_clip"])


def exact_value_loss_fn(loss_fn: Callable, cfg: ValueLossConfig) -> Callable:
    """The critic's micro-batch loss: ``sum_t COEF_t v_t / w_i`` over the step's numerator, ``v_t``
    AReaL's clipped squared error (``cfg``: ``critic.eps_clip`` and AReaL's 0.5) on AReaL's tensors
    (``values``: the value head's output, squeezed; ``input_data["values"]``: ``V_old``; ``returns``;
    the rolled ``loss_mask``). AReaL's own loss runs first, without gradient, for its statistics."""

    def loss(values: torch.Tensor, input_data: dict, **kwargs: Any) -> torch.Tensor:
        with torch.no_grad():
            loss_fn(values.detach(), input_data, **kwargs)  # AReaL's statistics of the micro-batch
        values = values.squeeze(-1)
        weight = input_data["loss_mask"].bool().sum()  # w_i, as AReaL's loss_weight_fn counts it
        per_token, _ = value_token_losses(values, input_data["values"], input_data["returns"], cfg)
        numerator = input_data[NUMERATOR].bool()
        return torch.where(numerator, per_token * input_data[COEF], 0.0).sum() / weight

    loss.__wrapped__ = loss_fn
    return loss


class ResponseGroupBaseline:
    """GRPO's group baseline, per response: in each prompt group, a response's value ``v_i`` is its
    advantage, which AReaL's ``compute_advantages`` gives every valid token of the response alike
    when there is no critic, no KL in the reward (``actor.kl_ctl=0``), and discount and GAE lambda
    1 (the plug-in refuses other settings at start-up, and a batch whose advantages still vary along
    a response here); every valid token gets

        v_i - mean_j v_j                        (``std=False``; Dr. GRPO)
        (v_i - mean_j v_j) / (std_j v_j + eps)  (``std=True``; GRPO)

    with the mean and std over the group's responses that have a valid token, each counted once.
    A group whose values are all equal (a singleton group among them) carries no comparison: every
    response in it gets advantage 0, never a difference of rounding divided by ``eps``.
    AReaL's own group normalisation (``actor.adv_norm`` with ``mean_level: group``) weights every
    token instead, so a long response pulls the baseline toward its own reward: rewards 1 and 0 on
    responses of 1 and 3 tokens give 0.25 there, 0.5 here. Used in place of AReaL's ``adv_norm``
    (same call signature); ``group_sizes`` are the rows of each group, in order, set per batch."""

    RELATIVE_TOLERANCE = 1e-6
    """How far (relative to ``max(1, |v_i|)``) a valid token's advantage may be from its response's
    first one before the batch is refused as varying along the response (float32 rounding of an
    upstream computation, never a KL term or a discount, which move it by far more)."""

    def __init__(self, *, std: bool, eps: float = 1e-5, unbiased: bool = True):
        self.std, self.eps, self.unbiased = std, eps, unbiased
        self.group_sizes: Optional[list] = None

    @torch.no_grad()
    def __call__(self, advantages: torch.Tensor, loss_mask: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.group_sizes is None or sum(self.group_sizes) != advantages.shape[0]:
            raise ArealBatchError(f"the response group baseline needs the batch's groups: {self.group_sizes} for "
                                  f"{advantages.shape[0]} rows")
        mask = loss_mask.bool()
        counts = mask.sum(1)
        values = _response_values(advantages, mask, self.RELATIVE_TOLERANCE)
        out = torch.zeros_like(advantages)
        start = 0
        for size in self.group_sizes:
            rows = slice(start, start + size)
            start += size
            active = values[rows][counts[rows] > 0]
            if active.numel() == 0 or bool(active.max() == active.min()):
                continue  # no comparison in the group: advantage 0
            centred = values[rows] - active.mean()
            if self.std:
                centred = centred / (active.std(unbiased=self.unbiased) + self.eps)
            out[rows] = centred.unsqueeze(1) * mask[rows]
        return out


def _response_values(advantages: torch.Tensor, mask: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Each row's advantage at its first valid token (0 for a row without one), after checking that
    every valid token of the row holds it (to ``tolerance`` relative to ``max(1, |v|)``); raises
    :class:`ArealBatchError` naming AReaL's keys otherwise."""
    first = torch.argmax(mask.to(torch.int8), dim=1)
    values = torch.where(mask.any(1), advantages.gather(1, first.unsqueeze(1)).squeeze(1), 0.0)
    deviation = torch.where(mask, (advantages - values.unsqueeze(1)).abs(), 0.0).amax(1)
    if bool((deviation > tolerance * values.abs().clamp(min=1.0)).any()):
        row = int(torch.argmax(deviation))
        raise ArealBatchError(
            f"the response group baseline needs one advantage per response, but row {row}'s advantages vary "
            f"along its valid tokens by up to {float(deviation[row]):.3g} (a KL in the reward, a discount or "
            "GAE lambda below 1, or a critic's values): set actor.kl_ctl=0, actor.discount=1 and "
            "actor.gae_lambda=1, or drop group_baseline")
    return values
