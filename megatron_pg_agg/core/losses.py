"""Per-token policy-gradient losses on vocab-parallel logits, and their step-level combination.

Everything here is per token and elementwise (plus reductions over the local vocabulary shard and
differentiable all-reduces over the tensor-parallel group): no host sync, no gather of the full
vocabulary. Every TP rank computes the same per-token values, so the loss and count it returns are
identical across TP, which is what Megatron-core's loss contract requires.

The step objective, with the aggregation of :mod:`megatron_pg_agg.core.aggregation` (c_t, k_t):

    J = sum_t c_t where(n_t, pg_t, 0) / W_pg
        + kl_coef * sum_t where(d_t, kl_t, 0) / D  -  entropy_coef * sum_t where(d_t, H_t, 0) / D

with ``W_pg = sum_t k_t`` and ``D = sum_t d_t`` (the extra terms are token means over the
original loss mask). Megatron divides the summed loss by ONE count (W_pg), so each microbatch
returns ``sum_t c_t pg_t + (W_pg / D) * sum_t (kl_coef kl_t - entropy_coef H_t)`` with count
``sum_t k_t``: both global totals are known on the host before the step (the planner's
``StepTotals``).

Policy losses (``PGLossConfig.policy_loss``): ``pg_t`` is one of, with ``x_t = logp_t - old_t``,
``A_t`` the advantage, ``sg`` stop-gradient, ``S_i = sum_t n_t x_t`` and ``N_i = sum_t n_t``
over ALL of sequence i's tokens (other CP ranks included; ``N_i`` is host data from the planner):

* ``ppo``: ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, ``r = exp(x)`` (dual clip optional);
* ``gspo`` (GSPO-token): the same with ``r'_t = exp(logp_t - sg(logp_t)) * sg(exp(S_i / N_i))``;
  under ``seq_mean`` with sequence-constant advantages it is the paper's sequence-level GSPO
  (value and gradient); the other modes weight it by length;
* ``gmpo``: ``-A exp(m_t - sg(m_t) + sg(M_i / N_i))`` with ``m_t = a min(a x_t, a clamp(x_t,
  -eps_low, eps_high))``, ``a = sign(A_t)``, ``M_i = sum_t n_t m_t``: under ``seq_mean`` it is the
  geometric-mean objective ``-A_i exp(M_i / N_i)`` with its exact gradient;
* ``cispo``: ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp`` (token level).

The sequence statistics ``S_i``/``M_i`` are detached sums: ONE all-reduce of a ``[sequences in the
part]`` vector over the context-parallel group per microbatch (none for ppo/cispo), no host sync.
A rollout-engine correction (:mod:`.rollout_correction`, on the host) multiplies ``pg_t`` by a
per-token weight and/or removes tokens from the numerator; it never touches the KL and entropy terms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from .aggregation import TokenWeights, weighted_sum
from .modes import TOKEN_MEAN, resolve_mode
from .segments import segment_of

KL_ESTIMATORS = ("k1", "k2", "k3")

POLICY_LOSSES = ("ppo", "gspo", "gmpo", "cispo")
SEQUENCE_POLICY_LOSSES = ("gspo", "gmpo")
"""Policy losses that need a per-sequence statistic (one CP all-reduce per microbatch)."""
ROLLOUT_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

REPORT_KEYS = ("objective", "pg_loss", "clip_fraction", "ratio", "kl", "entropy")
"""The ``[sum, count]`` pairs :func:`pg_loss_sum` reports (``kl`` and ``entropy`` when computed)."""
CORRECTION_REPORT_KEYS = ("correction_masked", "correction_truncated", "correction_weight")
"""Pairs recorded with a rollout correction: tokens masked / truncated over valid tokens, and the
mean PG weight over numerator tokens (host sums of the whole step, from the planner's plan)."""


@dataclass(frozen=True)
class StepTotals:
    """Global integers of one optimizer step, known on the host before it (the planner sees the
    whole step on every rank, so no collective is needed to know them)."""

    pg_weight: int
    """W_pg = sum of k_t over the step: valid tokens, active sequences or active groups."""
    valid_tokens: int
    """D = sum of d_t over the step: the normaliser of the KL and entropy token means."""

    @property
    def extra_scale(self) -> float:
        """W_pg / D: turns the extra terms' token mean into Megatron's single-count contract."""
        return self.pg_weight / self.valid_tokens if self.valid_tokens else 0.0


def correction_values(stats: Optional[dict]) -> dict:
    """``{key: sum / count or None}`` of a plan's ``correction_stats`` (empty without a
    correction), for the keys of ``CORRECTION_REPORT_KEYS``: both entries record them per step."""
    if stats is None:
        return {}
    return {name: stats[name][0] / stats[name][1] if stats[name][1] else None for name in CORRECTION_REPORT_KEYS}


def report_values(pairs: dict, pg_weight: int) -> dict:
    """``{key: sum / count or None}`` of reduced ``{key: [sum, count]}`` pairs (None for a missing
    key or a zero count: a term not computed), for every key of ``REPORT_KEYS``; a ``W = 0``
    step's objective is 0 by the contract (its pair is 0 / 0). Both entries' records go through
    here."""
    out = {}
    for name in REPORT_KEYS:
        total, count = pairs.get(name, (0.0, 0.0))
        out[name] = total / count if count else None
    if out["objective"] is None and pg_weight == 0:
        out["objective"] = 0.0
    return out


@dataclass(frozen=True)
class PGLossConfig:
    """What the actor optimises. Validated on construction (host side, before any step)."""

    mode: str = TOKEN_MEAN
    """Aggregation mode: token_mean, seq_mean, prompt_mean or constant. A peer alias is accepted
    and resolved on construction: afterwards this holds the canonical mode."""
    divisor: Optional[float] = None
    """L of the constant mode (e.g. the maximum response length); refused by other modes."""
    clip_eps_low: float = 0.2
    """PPO lower clip: ratio is clipped below at 1 - clip_eps_low."""
    clip_eps_high: Optional[float] = None
    """PPO upper clip (DAPO's clip-higher): ratio clipped above at 1 + clip_eps_high; None = clip_eps_low."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1: for negative advantages the loss is capped at -A * c; None = off."""
    kl_coef: float = 0.0
    """Weight of the KL penalty against the reference policy (needs reference log-probs)."""
    kl_estimator: str = "k3"
    """KL estimator per token: k1 = log(pi/ref), k2 = 0.5 log(pi/ref)^2, k3 = ref/pi - log(ref/pi) - 1."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    report_entropy: bool = True
    """Compute the entropy for the report even when entropy_coef is 0 (one more pass over the
    vocabulary shard and, with TP, one more small all-reduce per microbatch)."""
    policy_loss: str = "ppo"
    """Per-token policy loss: ppo, gspo, gmpo or cispo (module docstring); the aggregation mode
    stays orthogonal."""
    rollout_correction: Optional[str] = None
    """Rollout-engine correction from ``rollout_logprobs`` (:mod:`.rollout_correction`, host):
    token_truncate (TIS), token_mask, sequence_truncate, sequence_mask; None = off."""
    rollout_correction_max: float = 2.0
    """C: truncation cap of the importance weight, and upper bound of the masks."""
    rollout_correction_min: float = 0.0
    """c: lower bound of the masks (tokens or sequences with weight below it leave the numerator)."""
    def __post_init__(self):
        # resolved once, here: afterwards ``mode`` is the canonical mode (a peer alias given is
        # replaced by it) and ``divisor`` the divisor it implies
        mode, divisor = resolve_mode(self.mode, self.divisor)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "divisor", divisor)
        if self.clip_eps_high is None:
            object.__setattr__(self, "clip_eps_high", self.clip_eps_low)
        if not 0 < self.clip_eps_low < 1:
            raise ValueError(f"clip_eps_low must be in (0, 1); got {self.clip_eps_low}")
        if not self.clip_eps_high > 0:
            raise ValueError(f"clip_eps_high must be positive; got {self.clip_eps_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 (it caps -A * ratio for A < 0); got {self.dual_clip}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}; got {self.kl_estimator!r}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(
                f"kl_coef and entropy_coef must be >= 0; got {self.kl_coef}, {self.entropy_coef}"
            )
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of {POLICY_LOSSES}; got {self.policy_loss!r}")
        if self.dual_clip is not None and self.policy_loss != "ppo":
            raise ValueError(f"dual_clip applies to the ppo policy loss only; got policy_loss={self.policy_loss!r}")
        if self.rollout_correction is not None and self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout_correction must be one of {ROLLOUT_CORRECTIONS} or None; "
                             f"got {self.rollout_correction!r}")
        if not self.rollout_correction_max > self.rollout_correction_min >= 0:
            raise ValueError(
                "rollout correction bounds need C > c >= 0 (weights are capped at C; masks keep "
                f"[c, C]); got C={self.rollout_correction_max}, c={self.rollout_correction_min}")

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef > 0 or self.report_entropy

    @property
    def needs_sequence_statistic(self) -> bool:
        """gspo/gmpo: a per-sequence sum over all of a sequence's tokens (CP all-reduce)."""
        return self.policy_loss in SEQUENCE_POLICY_LOSSES


class _AllReduceSum(torch.autograd.Function):
    """Sum over the TP group; backward is the identity because every TP rank holds the same
    downstream loss, so d(loss)/d(local part) = d(loss)/d(sum)."""

    @staticmethod
    def forward(ctx, tensor, group):
        tensor = tensor.clone()
        torch.distributed.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _tp_sum(tensor: torch.Tensor, group, world: int) -> torch.Tensor:
    return tensor if world == 1 else _AllReduceSum.apply(tensor, group)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group=None,
    with_entropy: bool = False,
):
    """Log-probability of ``target`` (and optionally the entropy) from vocab-sharded logits.

    ``logits`` ``[..., V / tp]`` holds this TP rank's contiguous vocabulary shard (Megatron's
    layout: rank r owns ids ``[r * V/tp, (r+1) * V/tp)``); ``target`` ``[...]`` holds global ids.
    Computed in float32 with a detached max for stability; two small all-reduces over
    ``tp_group`` per call (the max, then the stacked sums), with or without the entropy. The
    input is not modified (megatron-core's vocab_parallel_cross_entropy works in place on fp32
    logits).
    """
    world = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    rank = 0 if tp_group is None else torch.distributed.get_rank(tp_group)
    logits = logits.float()
    shard = logits.shape[-1]
    with torch.no_grad():
        row_max = logits.max(dim=-1).values
        if world > 1:
            torch.distributed.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    shifted = logits - row_max.unsqueeze(-1)
    exps = shifted.exp()
    local = target - rank * shard
    in_shard = (local >= 0) & (local < shard)
    picked = shifted.gather(-1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)
    # Every quantity below is a sum over the vocabulary of purely local terms, so ONE all-reduce
    # of the stacked partial sums gives them all (two TP collectives per microbatch in all, one
    # fewer than megatron-core's vocab_parallel_cross_entropy), and the identity backward of that
    # all-reduce is exact. Entropy: H = log Z - sum_v e^{x_v} x_v / Z. (Writing it as
    # log Z - sum_v p_v x_v with p_v = e^{x_v} / Z would put Z inside each rank's local term, and
    # each rank's backward would miss the other shards' dependence on Z: the parity suite caught
    # that.)
    partial = [exps.sum(dim=-1), torch.where(in_shard, picked, 0.0)]
    if with_entropy:
        partial.append((exps * shifted).sum(dim=-1))
    sums = _tp_sum(torch.stack(partial, dim=-1), tp_group, world)
    z = sums[..., 0]
    log_z = torch.log(z)
    logprobs = sums[..., 1] - log_z
    if not with_entropy:
        return logprobs, None
    entropy = log_z - sums[..., 2] / z
    return logprobs, entropy


def clipped_surrogate(ratio, advantages, cfg: PGLossConfig):
    """``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` and whether the clip was active."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def ppo_token_losses(logprobs, old_logprobs, advantages, cfg: PGLossConfig):
    """Per-token clipped surrogate ``pg_t`` and the ratio / clipped indicator for statistics.

    pg = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); with dual clip, for A < 0 it is
    further capped at -A * c. Inputs at masked positions must be finite (the planner zeroes them):
    a NaN there would not reach the loss but would poison the gradient of exp().
    """
    ratio = torch.exp(logprobs - old_logprobs)
    loss, was_clipped = clipped_surrogate(ratio, advantages, cfg)
    if cfg.dual_clip is not None:
        cap = -advantages * cfg.dual_clip
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        was_clipped = was_clipped | dual
    return loss, ratio, was_clipped


class SequenceStatistic:
    """Per-sequence sums of one part (a microbatch, on one CP rank), completed over the CP group.

    ``cu_seqlens`` are the part's local sequence boundaries (packed; with CP, this rank's share of
    each sequence is contiguous: the padded boundaries divided by the CP size), ``num_tokens`` the
    host counts ``N_i`` of each sequence's numerator tokens over ALL CP ranks. ``mean(values, n)``
    returns, per token, ``sg(sum_{t in i} n_t v_t) / N_i`` of the token's sequence (0 where
    ``N_i = 0``): one detached all-reduce of a ``[sequences]`` vector, no host sync.
    """

    def __init__(self, cu_seqlens: torch.Tensor, num_tokens: torch.Tensor, total: int, cp_group=None):
        positions = torch.arange(total, device=cu_seqlens.device)
        self.segment = segment_of(cu_seqlens, positions)
        self.segment = self.segment.clamp_(max=num_tokens.numel() - 1)  # padding past the last boundary
        self.num_tokens = num_tokens.to(torch.float32)
        self.cp_group = cp_group

    def mean(self, values: torch.Tensor, numerator_mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            sums = torch.zeros_like(self.num_tokens).index_add_(
                0, self.segment, torch.where(numerator_mask, values.float(), 0.0))
            if self.cp_group is not None and torch.distributed.get_world_size(self.cp_group) > 1:
                torch.distributed.all_reduce(sums, group=self.cp_group)
            mean = torch.where(self.num_tokens > 0, sums / self.num_tokens.clamp(min=1.0), 0.0)
        return mean[self.segment]


def policy_token_losses(logprobs, old_logprobs, advantages, numerator_mask, cfg: PGLossConfig,
                        sequences: Optional[SequenceStatistic] = None):
    """``(pg_t, ratio_t, clipped_t)`` for ``cfg.policy_loss`` (formulas in the module docstring);
    gspo/gmpo need ``sequences``. ``ratio_t`` is the importance ratio each loss uses (reported)."""
    if cfg.policy_loss == "ppo":
        return ppo_token_losses(logprobs, old_logprobs, advantages, cfg)
    log_ratio = logprobs - old_logprobs
    if cfg.policy_loss == "cispo":
        ratio = torch.exp(log_ratio)
        weight = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high).detach()
        return -weight * advantages * logprobs, ratio, weight != ratio.detach()
    if sequences is None:
        raise ValueError(f"policy_loss={cfg.policy_loss!r} needs the part's sequences (cu_seqlens and "
                         "the planner's per-sequence numerator counts)")
    if cfg.policy_loss == "gspo":
        seq_ratio = torch.exp(sequences.mean(log_ratio, numerator_mask))  # s_i, detached
        ratio = torch.exp(logprobs - logprobs.detach()) * seq_ratio  # value s_i, gradient s_i dlogp
        loss, was_clipped = clipped_surrogate(ratio, advantages, cfg)
        return loss, ratio, was_clipped
    # gmpo: clip in log space, sign-aware; the value is the sequence's geometric mean
    sign = torch.where(advantages >= 0, 1.0, -1.0)
    clipped_log = torch.clamp(log_ratio, -cfg.clip_eps_low, cfg.clip_eps_high)
    m = sign * torch.minimum(sign * log_ratio, sign * clipped_log)
    seq_mean = sequences.mean(m, numerator_mask)  # M_i / N_i, detached
    ratio = torch.exp(m - m.detach() + seq_mean)
    return -advantages * ratio, ratio, m.detach() != log_ratio.detach()


def kl_penalty(logprobs, ref_logprobs, estimator: str):
    """Per-token KL(pi || ref) estimate from sampled tokens (Schulman's k1/k2/k3)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.exp(-log_ratio) + log_ratio - 1.0


class LossInputs(Protocol):
    """The per-token tensors of one part of a step (``[T]`` each) that :func:`pg_loss_sum` reads;
    a planner :class:`~megatron_pg_agg.data.planner.Microbatch` is one."""

    old_logprobs: torch.Tensor
    """float32: behaviour-policy log-probs."""
    advantages: torch.Tensor
    """float32."""
    numerator_mask: torch.Tensor
    """bool: n_t."""
    denominator_mask: torch.Tensor
    """bool: d_t."""
    token_weights: TokenWeights
    """The aggregation weights (c_t, k_t) of these tokens, from the step's ``token_weights``."""
    ref_logprobs: Optional[torch.Tensor]
    """float32 reference log-probs, or None (no KL term)."""
    correction_weights: Optional[torch.Tensor]
    """float32 rollout-correction weights multiplying pg_t only, or None (weight 1)."""


@dataclass(frozen=True)
class LossPart:
    """A :class:`LossInputs` built by hand: the tensors of one part of a step where no planner
    :class:`~megatron_pg_agg.data.planner.Microbatch` exists (a custom data path, a benchmark)."""

    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    numerator_mask: torch.Tensor
    denominator_mask: torch.Tensor
    token_weights: TokenWeights
    ref_logprobs: Optional[torch.Tensor] = None
    correction_weights: Optional[torch.Tensor] = None


def pg_loss_sum(
    logprobs: torch.Tensor,
    part: LossInputs,
    totals: StepTotals,
    cfg: PGLossConfig,
    *,
    entropy: Optional[torch.Tensor] = None,
    sequences: Optional[SequenceStatistic] = None,
):
    """One part's ``(loss_sum, count, report)`` in Megatron-core's per-token-loss contract.

    ``logprobs``: the current policy's log-probs of ``part``'s tokens; ``entropy``: their entropy
    (None: not computed); ``sequences`` (gspo/gmpo): the part's :class:`SequenceStatistic`.

    ``report`` maps names to detached float32 ``[sum, count]`` pairs that Megatron-LM's logger
    sums over microbatches and DP x CP ranks and divides: ``objective`` (the full J),
    ``pg_loss`` (J_pg), ``clip_fraction`` and ``ratio`` (over numerator tokens), ``kl`` and
    ``entropy`` (over denominator tokens) when computed.
    """
    numerator_mask, denominator_mask = part.numerator_mask, part.denominator_mask
    ref_logprobs = part.ref_logprobs
    pg, ratio, was_clipped = policy_token_losses(logprobs, part.old_logprobs, part.advantages, numerator_mask,
                                                 cfg, sequences)
    if part.correction_weights is not None:
        pg = pg * part.correction_weights
    pg_sum, count = weighted_sum(pg, numerator_mask, part.token_weights, validate=False)
    loss_sum = pg_sum
    # counts straight from the bool masks: no float copies of per-token tensors
    num_tokens = numerator_mask.sum(dtype=torch.float32)
    den_tokens = denominator_mask.sum(dtype=torch.float32)
    count_f = count.to(torch.float32)
    report = {
        "pg_loss": torch.stack([pg_sum.detach(), count_f]),
        "clip_fraction": torch.stack([(was_clipped & numerator_mask).sum(dtype=torch.float32), num_tokens]),
        "ratio": torch.stack([torch.where(numerator_mask, ratio.detach(), 0.0).sum(), num_tokens]),
    }
    scale = totals.extra_scale
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs reference log-probs in every microbatch")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs the per-token entropy")
    if ref_logprobs is not None:  # reported whenever known; in the loss only with a coefficient
        kl = torch.where(denominator_mask, kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator), 0.0).sum()
        if cfg.kl_coef > 0:
            loss_sum = loss_sum + (cfg.kl_coef * scale) * kl
        report["kl"] = torch.stack([kl.detach(), den_tokens])
    if entropy is not None:
        ent = torch.where(denominator_mask, entropy, 0.0).sum()
        if cfg.entropy_coef > 0:
            loss_sum = loss_sum - (cfg.entropy_coef * scale) * ent
        report["entropy"] = torch.stack([ent.detach(), den_tokens])
    report["objective"] = torch.stack([loss_sum.detach().clone(), count_f])
    return loss_sum, count, report
