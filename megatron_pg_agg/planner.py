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
from .losses import StepTotals
from .modes import resolve_mode
from .rollouts import PlanError, Rollout, RolloutBatch, check_rollout  # noqa: F401  (re-exported)


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


def _gather_or_zero(values: Optional[torch.Tensor], index: torch.Tensor, keep: torch.Tensor):
    """``values[index]`` where ``keep``, else 0 (index is clamped: masked positions read nothing
    meaningful, and a NaN there would poison the gradient of exp() in the loss)."""
    if values is None:
        return None
    if values.numel() == 0:
        return torch.zeros(index.shape, dtype=values.dtype)
    picked = values[index.clamp(0, values.numel() - 1)]
    return torch.where(keep, picked, torch.zeros((), dtype=values.dtype))


def _canonical_order(group_index: torch.Tensor):
    """Rollout order with groups consecutive (in order of first appearance, stable inside a group),
    and the group sizes in that order."""
    n = group_index.numel()
    uniq, inverse = torch.unique(group_index, return_inverse=True)
    first = torch.full((uniq.numel(),), n, dtype=torch.long).scatter_reduce_(
        0, inverse, torch.arange(n), reduce="amin")
    order = torch.argsort(first[inverse] * n + torch.arange(n))
    sizes = torch.bincount(inverse, minlength=uniq.numel())[torch.argsort(first)]
    return order, sizes.tolist()


def _cp_index(padded: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """Positions CP rank ``cp_rank`` keeps in a packed run of sequences with ``padded`` lengths
    (chunks r and 2cp-1-r of each): the vectorised form of context_parallel.cp_partition_index."""
    chunk = padded // (2 * cp)
    starts = torch.zeros_like(padded)
    starts[1:] = torch.cumsum(padded, 0)[:-1]
    firsts = torch.stack([starts + cp_rank * chunk, starts + (2 * cp - 1 - cp_rank) * chunk], 1).reshape(-1)
    lengths = chunk.repeat_interleave(2)
    total = int(lengths.sum())
    base = torch.repeat_interleave(firsts, lengths, output_size=total)
    offsets = torch.zeros_like(lengths)
    offsets[1:] = torch.cumsum(lengths, 0)[:-1]
    return base + torch.arange(total) - torch.repeat_interleave(offsets, lengths, output_size=total)


def plan_step(
    rollouts,
    loss_cfg,
    plan_cfg: PlanConfig,
    *,
    cp_rank: int = 0,
) -> StepPlan:
    """Plan one optimizer step (see the module docstring).

    ``rollouts`` is a list of :class:`Rollout` or a :class:`RolloutBatch` (the fast path for big
    steps); ``loss_cfg`` a :class:`~megatron_pg_agg.losses.PGLossConfig` (mode, divisor, whether
    reference log-probs are needed). Microbatch ``m`` of DP rank ``r`` is bin ``m * dp + r``.
    """
    mode, divisor = resolve_mode(loss_cfg.mode, loss_cfg.divisor)
    if isinstance(rollouts, RolloutBatch):
        batch = rollouts
        batch.validate(vocab_size=plan_cfg.vocab_size)
    else:
        if not rollouts:
            raise PlanError("the step has no rollouts")
        batch = RolloutBatch.from_rollouts(rollouts, vocab_size=plan_cfg.vocab_size)
    if loss_cfg.needs_reference and batch.ref_logprobs is None:
        raise PlanError("ref_logprobs is missing (on at least one rollout) but kl_coef > 0 needs it")
    num_seqs = len(batch)

    # 2. canonical order and padding
    order, group_sizes = _canonical_order(batch.group_index)
    multiple = plan_cfg.pad_multiple
    prompt = batch.prompt_lengths[order]
    length = prompt + batch.response_lengths[order]
    padded = (length + multiple - 1) // multiple * multiple
    cap = plan_cfg.max_tokens_per_microbatch
    if cap is not None and bool((padded > cap).any()):
        k = int((padded > cap).int().argmax())
        i = int(order[k])
        label = batch.group_labels[int(batch.group_index[i])] if batch.group_labels else int(batch.group_index[i])
        raise PlanError(
            f"rollout {i} (group {label!r}): {int(length[k])} tokens (prompt {int(prompt[k])} + response "
            f"{int(length[k] - prompt[k])}, padded to {int(padded[k])}) do not fit a microbatch of "
            f"max_tokens_per_microbatch={cap}; raise the capacity or drop the sequence")
    offsets = torch.zeros(num_seqs + 1, dtype=torch.long)
    torch.cumsum(padded, 0, out=offsets[1:])
    total = int(offsets[-1])

    # per-token host tensors of the whole step, canonical order, padded layout (vectorised)
    seq = torch.repeat_interleave(torch.arange(num_seqs), padded, output_size=total)
    pos = torch.arange(total) - offsets[seq]
    p_tok, l_tok = prompt[seq], length[seq]
    p_start = torch.zeros(num_seqs + 1, dtype=torch.long)
    torch.cumsum(batch.prompt_lengths, 0, out=p_start[1:])
    r_start = torch.zeros(num_seqs + 1, dtype=torch.long)
    torch.cumsum(batch.response_lengths, 0, out=r_start[1:])
    p_first, r_first = p_start[order][seq], r_start[order][seq]
    in_prompt = pos < p_tok
    in_resp = ~in_prompt & (pos < l_tok)
    tokens = torch.where(in_prompt, _gather_or_zero(batch.prompt_tokens, p_first + pos, in_prompt),
                         _gather_or_zero(batch.response_tokens, r_first + pos - p_tok, in_resp))
    labels = torch.zeros_like(tokens)
    labels[:-1] = tokens[1:]
    labels = torch.where(pos + 1 < l_tok, labels, 0)
    scored = (pos >= p_tok - 1) & (pos < l_tok - 1)
    r_index = r_first + pos - p_tok + 1
    den = _gather_or_zero(batch.loss_mask, r_index, scored)
    num = den if batch.numerator_mask is None else _gather_or_zero(batch.numerator_mask, r_index, scored)
    fields_ = {
        "tokens": tokens, "labels": labels, "position_ids": pos,
        "numerator_mask": num, "denominator_mask": den,
        "advantages": _gather_or_zero(batch.advantages, r_index, den),
        "old_logprobs": _gather_or_zero(batch.old_logprobs, r_index, den),
        "ref_logprobs": _gather_or_zero(batch.ref_logprobs, r_index, den),
    }

    # 3. token weights ONCE for the whole step, before any split
    weights = token_weights(num, mode=mode, divisor=divisor, cu_seqlens=offsets, group_sizes=group_sizes,
                            denominator_mask=den, validate=False)
    totals = StepTotals(pg_weight=int(weights.count.sum()), valid_tokens=int(den.sum()))

    # 4. whole sequences onto token-balanced bins; bin b -> DP rank b % dp, microbatch b // dp
    dp = plan_cfg.dp_size
    padded_list = padded.tolist()
    num_mb = _choose_microbatches(padded_list, plan_cfg)
    bins = _lpt_bins(padded_list, dp * num_mb)
    empty = sum(1 for members in bins if not members)
    if empty:
        raise PlanError(
            f"{num_seqs} sequences cannot fill {dp} DP ranks x {num_mb} microbatches: {empty} "
            "microbatches would be empty; use fewer microbatches or a larger step")

    # 5. one gather puts every bin's tokens contiguous; microbatches are slices of it
    perm = torch.tensor([s for members in bins for s in members], dtype=torch.long)
    perm_padded = padded[perm]
    perm_starts = torch.zeros(num_seqs + 1, dtype=torch.long)
    torch.cumsum(perm_padded, 0, out=perm_starts[1:])
    within = torch.arange(total) - torch.repeat_interleave(perm_starts[:-1], perm_padded, output_size=total)
    token_perm = torch.repeat_interleave(offsets[perm], perm_padded, output_size=total) + within
    cp = plan_cfg.cp_size
    if cp > 1:
        token_perm = token_perm[_cp_index(perm_padded, cp, cp_rank)]
    permuted = {k: (None if v is None else v[token_perm]) for k, v in fields_.items()}
    permuted_weights = weights[token_perm]
    uniform = max(sum(padded_list[s] for s in members) for members in bins)

    microbatches = [[None] * num_mb for _ in range(dp)]
    bin_tokens = [[0] * num_mb for _ in range(dp)]
    start = 0
    for b, members in enumerate(bins):
        rank, mb = b % dp, b // dp
        seq_padded = [padded_list[s] for s in members]
        seq_real = [int(length[s]) for s in members]
        size = sum(seq_padded)
        part = slice(start // cp, (start + size) // cp)
        start += size
        bin_tokens[rank][mb] = size
        extra = uniform - size if plan_cfg.uniform_microbatch_tokens else 0
        if extra and cp > 1:
            raise PlanError("uniform_microbatch_tokens with cp_size > 1 is not supported: the extra "
                            "padding would not follow the CP chunk layout")
        if extra:  # the last sequence's padding grows; the extra positions score nothing
            seq_padded[-1] += extra
        cut = {k: (None if v is None else v[part]) for k, v in permuted.items()}
        w = permuted_weights[part]
        if extra:
            pad = extra // cp
            cut = {k: (None if v is None else torch.cat([v, v.new_zeros(pad)])) for k, v in cut.items()}
            w = TokenWeights.cat([w, TokenWeights(w.coef.new_zeros(pad), w.count.new_zeros(pad), w.mode)])
        microbatches[rank][mb] = Microbatch(
            tokens=cut["tokens"].unsqueeze(0),
            labels=cut["labels"].unsqueeze(0),
            position_ids=cut["position_ids"].unsqueeze(0),
            numerator_mask=cut["numerator_mask"],
            denominator_mask=cut["denominator_mask"],
            advantages=cut["advantages"],
            old_logprobs=cut["old_logprobs"],
            ref_logprobs=cut["ref_logprobs"],
            weights=w,
            cu_seqlens=torch.tensor([0, *_running(seq_real)], dtype=torch.int32),
            cu_seqlens_padded=torch.tensor([0, *_running(seq_padded)], dtype=torch.int32),
            max_seqlen=max(seq_padded),
            sequence_ids=order[torch.tensor(members)].tolist(),
        )
    flat = [t for row in bin_tokens for t in row]
    per_rank = [sum(row) for row in bin_tokens]
    stats = {
        "sequences": num_seqs,
        "groups": len(group_sizes),
        "tokens": int(length.sum()),
        "padded_tokens": total,
        "microbatches_per_rank": num_mb,
        "microbatch_balance": max(flat) / (sum(flat) / len(flat)),
        "rank_balance": max(per_rank) / (sum(per_rank) / len(per_rank)),
        "pg_weight": totals.pg_weight,
        "valid_tokens": totals.valid_tokens,
    }
    return StepPlan(microbatches, totals, group_sizes, bin_tokens, stats)


def _running(values: list) -> list:
    out, acc = [], 0
    for v in values:
        acc += v
        out.append(acc)
    return out


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
