"""Host-side step planning: one optimizer step of rollouts -> every DP rank's packed THD microbatches.

Runs on the host, identically on every rank (deterministic: no randomness, ties broken by index),
so every rank knows every rank's microbatches and the step's global totals without a collective.
Order of work, and why:

1. check the rollouts (host data: checks are free here, so the per-microbatch path can trust it);
2. put sequences in canonical order (groups consecutive, in order of first appearance) and pad
   each to what TP sequence parallelism and context parallelism need;
3. compute ``token_weights`` ONCE for the whole step, before any split: groups and sequences may
   then land in different microbatches, DP ranks or CP shards and the objective stays exact;
4. assign whole sequences (attention needs them whole) to DP x microbatch bins, token-balanced
   (longest-first onto the lightest bin);
5. pack each bin into THD tensors (cu_seqlens and cu_seqlens_padded) and, with CP, keep this CP
   rank's part of every per-token tensor (Megatron's layout, :mod:`megatron_pg_agg.context_parallel`).

Token positions: a sequence is ``prompt + response``; position t predicts token t+1, so response
token j (sequence index P + j) is scored at position P + j - 1, where its mask, advantage and
log-probs are placed. The last position and padding score nothing.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

import torch

from .aggregation import TokenWeights, token_weights
from .context_parallel import cp_partition_index
from .losses import StepTotals
from .modes import resolve_mode


@dataclass
class Rollout:
    """One response to one prompt, as produced by the rollout engine."""

    prompt_ids: Sequence[int]
    """Prompt token ids."""
    response_ids: Sequence[int]
    """Response token ids (at least one)."""
    loss_mask: Sequence[int]
    """Per response token: 1 if the token is trained on (the denominator mask d)."""
    advantages: Sequence[float]
    """Per response token advantage."""
    old_logprobs: Sequence[float]
    """Per response token log-prob under the behaviour policy."""
    group_id: object
    """Prompt-group identifier: responses to the same prompt share it."""
    ref_logprobs: Optional[Sequence[float]] = None
    """Per response token log-prob under the reference policy (needed for a KL penalty)."""
    numerator_mask: Optional[Sequence[int]] = None
    """Per response token: 0 removes a token from the numerator only (filtering); None = loss_mask."""


@dataclass
class Microbatch:
    """One packed THD microbatch (micro-batch size 1), with every per-token tensor it needs."""

    tokens: torch.Tensor  # int64 [1, T]
    labels: torch.Tensor  # int64 [1, T]: next token at every position (0 where nothing is scored)
    position_ids: torch.Tensor  # int64 [1, T]: restart at 0 in every sequence
    numerator_mask: torch.Tensor  # bool [T]
    denominator_mask: torch.Tensor  # bool [T]
    advantages: torch.Tensor  # float32 [T]
    old_logprobs: torch.Tensor  # float32 [T]
    ref_logprobs: Optional[torch.Tensor]  # float32 [T] or None
    weights: TokenWeights  # [T], sliced from the step's weights
    cu_seqlens: torch.Tensor  # int32 [S+1]: real sequence lengths
    cu_seqlens_padded: torch.Tensor  # int32 [S+1]: padded lengths (token offsets in this batch)
    max_seqlen: int
    sequence_ids: list  # canonical indices of the sequences packed here

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    def to(self, device) -> "Microbatch":
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device, non_blocking=True) if isinstance(value, (torch.Tensor, TokenWeights)) else value
        return Microbatch(**moved)


@dataclass
class StepPlan:
    """Every DP rank's microbatches for one step, and the step's global numbers."""

    microbatches: list  # [dp_rank][microbatch] -> Microbatch
    totals: StepTotals
    group_sizes: list
    bin_tokens: list  # [dp_rank][microbatch] -> padded tokens (before any CP split)
    stats: dict = field(default_factory=dict)

    def for_rank(self, dp_rank: int) -> list:
        return self.microbatches[dp_rank]


@dataclass(frozen=True)
class PlanConfig:
    """How to cut a step. Every field is host data; the same config on every rank gives the
    same plan."""

    dp_size: int = 1
    """Data-parallel ranks (Megatron's DP, without CP)."""
    num_microbatches: Optional[int] = None
    """Microbatches per DP rank; None = derive from max_tokens_per_microbatch."""
    max_tokens_per_microbatch: Optional[int] = None
    """Capacity of one microbatch in padded tokens (before the CP split)."""
    tp_size: int = 1
    """Tensor-parallel size (padding with sequence parallelism)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: every sequence is padded to a multiple of tp_size."""
    cp_size: int = 1
    """Context-parallel size: every sequence is padded to a multiple of 2 * cp_size."""
    vocab_size: Optional[int] = None
    """If set, token ids are checked against it."""
    uniform_microbatch_tokens: bool = False
    """Pad every microbatch of the step to the same token count (the last sequence's padding
    grows). Pipeline schedules without ``variable_seq_lengths`` need it: p2p buffers have one
    shape (the interleaved schedule's shape exchange deadlocks on gloo)."""

    @property
    def pad_multiple(self) -> int:
        tp = self.tp_size if self.sequence_parallel else 1
        cp = 2 * self.cp_size if self.cp_size > 1 else 1
        return tp * cp // math.gcd(tp, cp)


class PlanError(ValueError):
    """A step that cannot be planned; the message names the rollout and field."""


def _check_rollout(i: int, r: Rollout, vocab_size: Optional[int]) -> None:
    resp = len(r.response_ids)
    if resp == 0:
        raise PlanError(f"rollout {i}: response_ids is empty (a response needs at least one token)")
    for name in ("loss_mask", "advantages", "old_logprobs", "ref_logprobs", "numerator_mask"):
        values = getattr(r, name)
        if values is not None and len(values) != resp:
            raise PlanError(
                f"rollout {i}: {name} has {len(values)} entries but response_ids has {resp}"
            )
    if len(r.prompt_ids) == 0:
        raise PlanError(f"rollout {i}: prompt_ids is empty (the first response token needs a prompt position)")
    if vocab_size is not None:
        for name in ("prompt_ids", "response_ids"):
            for j, tok in enumerate(getattr(r, name)):
                if not 0 <= tok < vocab_size:
                    raise PlanError(f"rollout {i}: {name}[{j}]={tok} is outside the vocabulary [0, {vocab_size})")
    for j, (m, a, lp) in enumerate(zip(r.loss_mask, r.advantages, r.old_logprobs)):
        if m not in (0, 1, True, False):
            raise PlanError(f"rollout {i}: loss_mask[{j}]={m!r} must be 0 or 1")
        if m and not (math.isfinite(a) and math.isfinite(lp)):
            raise PlanError(f"rollout {i}: non-finite advantages/old_logprobs at valid position {j}")
        if m and r.ref_logprobs is not None and not math.isfinite(r.ref_logprobs[j]):
            raise PlanError(f"rollout {i}: non-finite ref_logprobs at valid position {j}")
    if r.numerator_mask is not None:
        for j, (n, m) in enumerate(zip(r.numerator_mask, r.loss_mask)):
            if n and not m:
                raise PlanError(f"rollout {i}: numerator_mask[{j}] is 1 where loss_mask is 0")


def check_fits(rollouts: Sequence[Rollout], plan_cfg: PlanConfig, *, step=None) -> None:
    """Raise PlanError naming the first rollout too long for one microbatch (attention needs a
    sequence whole, so it can never be split to fit)."""
    cap = plan_cfg.max_tokens_per_microbatch
    if cap is None:
        return
    multiple = plan_cfg.pad_multiple
    where = "" if step is None else f"step {step}, "
    for i, r in enumerate(rollouts):
        n = len(r.prompt_ids) + len(r.response_ids)
        padded = -(-n // multiple) * multiple
        if padded > cap:
            raise PlanError(
                f"{where}rollout {i} (group {r.group_id!r}): {n} tokens (prompt {len(r.prompt_ids)} + "
                f"response {len(r.response_ids)}, padded to {padded}) do not fit a microbatch of "
                f"max_tokens_per_microbatch={cap}; raise the capacity or drop the sequence"
            )


def _lpt_bins(lengths: list, num_bins: int) -> list:
    """Longest-first onto the lightest bin; ties broken by index, so the result is deterministic."""
    heap = [(0, b) for b in range(num_bins)]
    bins = [[] for _ in range(num_bins)]
    for idx in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(idx)
        heapq.heappush(heap, (load + lengths[idx], b))
    return [sorted(b) for b in bins]


def plan_step(
    rollouts: Sequence[Rollout],
    loss_cfg,
    plan_cfg: PlanConfig,
    *,
    cp_rank: int = 0,
    assignment: Optional[list] = None,
) -> StepPlan:
    """Plan one optimizer step (see the module docstring).

    ``loss_cfg`` is a :class:`~megatron_pg_agg.losses.PGLossConfig` (mode, divisor, whether
    reference log-probs are needed). ``assignment`` optionally fixes the bins: a list of
    ``dp_size * num_microbatches`` lists of rollout indices (canonical order), bin
    ``b`` -> DP rank ``b % dp_size``, microbatch ``b // dp_size`` (tests use it to force a group
    across microbatches or ranks).
    """
    if not rollouts:
        raise PlanError("the step has no rollouts")
    mode, divisor = resolve_mode(loss_cfg.mode, loss_cfg.divisor)
    for i, r in enumerate(rollouts):
        _check_rollout(i, r, plan_cfg.vocab_size)
        if loss_cfg.needs_reference and r.ref_logprobs is None:
            raise PlanError(f"rollout {i}: ref_logprobs is missing but kl_coef > 0 needs it")
    check_fits(rollouts, plan_cfg)

    # Canonical order: groups consecutive, in order of first appearance; stable inside a group.
    first_seen = {}
    for i, r in enumerate(rollouts):
        first_seen.setdefault(r.group_id, len(first_seen))
    order = sorted(range(len(rollouts)), key=lambda i: (first_seen[rollouts[i].group_id], i))
    seqs = [rollouts[i] for i in order]
    group_sizes = []
    for i, r in enumerate(seqs):
        if i and r.group_id == seqs[i - 1].group_id:
            group_sizes[-1] += 1
        else:
            group_sizes.append(1)

    multiple = plan_cfg.pad_multiple
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in seqs]
    padded = [-(-n // multiple) * multiple for n in lengths]
    total = sum(padded)

    # Per-token host tensors of the whole step, canonical order, padded layout.
    tokens = torch.zeros(total, dtype=torch.long)
    labels = torch.zeros(total, dtype=torch.long)
    position_ids = torch.zeros(total, dtype=torch.long)
    den = torch.zeros(total, dtype=torch.bool)
    num = torch.zeros(total, dtype=torch.bool)
    adv = torch.zeros(total, dtype=torch.float32)
    old = torch.zeros(total, dtype=torch.float32)
    # reference log-probs travel when the loss needs them or every rollout has them (KL report)
    with_ref = loss_cfg.needs_reference or all(r.ref_logprobs is not None for r in seqs)
    ref = torch.zeros(total, dtype=torch.float32) if with_ref else None
    offsets = [0]
    for n in padded:
        offsets.append(offsets[-1] + n)
    for s, r in enumerate(seqs):
        start, p, n = offsets[s], len(r.prompt_ids), lengths[s]
        ids = torch.tensor(list(r.prompt_ids) + list(r.response_ids), dtype=torch.long)
        tokens[start:start + n] = ids
        labels[start:start + n - 1] = ids[1:]
        position_ids[start:start + padded[s]] = torch.arange(padded[s])
        scored = slice(start + p - 1, start + n - 1)
        d = torch.tensor(list(r.loss_mask), dtype=torch.bool)
        den[scored] = d
        num[scored] = d & torch.tensor(list(r.numerator_mask), dtype=torch.bool) if r.numerator_mask is not None else d
        # masked positions stay 0: a NaN there would poison the gradient of exp() in the loss
        adv[scored] = torch.where(d, torch.tensor(list(r.advantages), dtype=torch.float32), 0.0)
        old[scored] = torch.where(d, torch.tensor(list(r.old_logprobs), dtype=torch.float32), 0.0)
        if ref is not None:
            ref[scored] = torch.where(d, torch.tensor(list(r.ref_logprobs), dtype=torch.float32), 0.0)

    cu_padded = torch.tensor(offsets, dtype=torch.int64)
    weights = token_weights(num, mode=mode, divisor=divisor, cu_seqlens=cu_padded,
                            group_sizes=group_sizes, denominator_mask=den)
    totals = StepTotals(pg_weight=int(weights.count.sum()), valid_tokens=int(den.sum()))
    # one all-zero row at index ``total``: the target of uniform-length padding
    tokens, labels, position_ids, num, den, adv, old = (
        torch.cat([t, t.new_zeros(1)]) for t in (tokens, labels, position_ids, num, den, adv, old))
    ref = None if ref is None else torch.cat([ref, ref.new_zeros(1)])
    weights = TokenWeights.cat([weights, TokenWeights(weights.coef.new_zeros(1), weights.count.new_zeros(1), weights.mode)])

    dp = plan_cfg.dp_size
    if assignment is not None:
        bins = [sorted(b) for b in assignment]
        if len(bins) % dp:
            raise PlanError(f"assignment has {len(bins)} bins, not a multiple of dp_size={dp}")
        placed = sorted(i for b in bins for i in b)
        if placed != list(range(len(seqs))):
            raise PlanError("assignment must place every sequence exactly once")
        num_mb = len(bins) // dp
    else:
        num_mb = _choose_microbatches(padded, plan_cfg)
        bins = _lpt_bins(padded, dp * num_mb)
    empty = [b for b, members in enumerate(bins) if not members]
    if empty:
        raise PlanError(
            f"{len(seqs)} sequences cannot fill {dp} DP ranks x {num_mb} microbatches: "
            f"{len(empty)} microbatches would be empty; use fewer microbatches or a larger step"
        )

    cp = plan_cfg.cp_size
    uniform = max(sum(padded[s] for s in members) for members in bins)
    microbatches = [[None] * num_mb for _ in range(dp)]
    bin_tokens = [[0] * num_mb for _ in range(dp)]
    for b, members in enumerate(bins):
        rank, mb = b % dp, b // dp
        index = torch.cat([torch.arange(offsets[s], offsets[s + 1]) for s in members])
        seq_padded = [padded[s] for s in members]
        if plan_cfg.uniform_microbatch_tokens and sum(seq_padded) < uniform:
            # extend the last sequence's padding with positions that score nothing (index
            # ``total`` points at an all-zero row appended to every per-token tensor below)
            extra = uniform - sum(seq_padded)
            seq_padded[-1] += extra
            index = torch.cat([index, torch.full((extra,), total, dtype=torch.long)])
        cu_p = torch.tensor([0, *torch.tensor(seq_padded).cumsum(0).tolist()], dtype=torch.int32)
        real = [lengths[s] for s in members]
        cu_r = torch.tensor([0, *torch.tensor(real).cumsum(0).tolist()], dtype=torch.int32)
        bin_tokens[rank][mb] = int(cu_p[-1])
        if cp > 1:
            index = index[cp_partition_index(seq_padded, cp, cp_rank)]
        microbatches[rank][mb] = Microbatch(
            tokens=tokens[index].unsqueeze(0),
            labels=labels[index].unsqueeze(0),
            position_ids=position_ids[index].unsqueeze(0),
            numerator_mask=num[index],
            denominator_mask=den[index],
            advantages=adv[index],
            old_logprobs=old[index],
            ref_logprobs=None if ref is None else ref[index],
            weights=weights[index],
            cu_seqlens=cu_r,
            cu_seqlens_padded=cu_p,
            max_seqlen=max(seq_padded),
            sequence_ids=[order[s] for s in members],
        )
    flat = [t for row in bin_tokens for t in row]
    per_rank = [sum(row) for row in bin_tokens]
    stats = {
        "sequences": len(seqs),
        "groups": len(group_sizes),
        "tokens": sum(lengths),
        "padded_tokens": total,
        "microbatches_per_rank": num_mb,
        "microbatch_balance": max(flat) / (sum(flat) / len(flat)),
        "rank_balance": max(per_rank) / (sum(per_rank) / len(per_rank)),
        "pg_weight": totals.pg_weight,
        "valid_tokens": totals.valid_tokens,
    }
    return StepPlan(microbatches, totals, group_sizes, bin_tokens, stats)


def _choose_microbatches(padded: list, cfg: PlanConfig) -> int:
    if cfg.num_microbatches is not None:
        if cfg.num_microbatches < 1:
            raise PlanError(f"num_microbatches must be >= 1; got {cfg.num_microbatches}")
        return cfg.num_microbatches
    cap = cfg.max_tokens_per_microbatch
    if cap is None:
        return 1
    num_mb = max(1, -(-sum(padded) // (cfg.dp_size * cap)))
    while True:  # LPT may overflow a bin that a perfect packing would not: add microbatches
        bins = _lpt_bins(padded, cfg.dp_size * num_mb)
        if max(sum(padded[i] for i in b) for b in bins) <= cap:
            return num_mb
        num_mb += 1
