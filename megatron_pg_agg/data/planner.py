"""Host-side step planning: one optimizer step of rollouts -> every DP rank's packed THD microbatches.

Runs on the host, identically on every rank (deterministic: no randomness, ties broken by index),
so every rank knows every rank's microbatches and the step's global totals without a collective.
Order of work, and why:

Each phase is a function below; ``plan_step`` reads as their list.

1. check the rollouts (host data: checks are free here, so the per-microbatch path can trust it)
   and apply the rollout-engine correction to the numerator (``checked_batch``);
2. put sequences in canonical order (groups consecutive, in order of first appearance) and pad
   each to what TP sequence parallelism and context parallelism need (``canonical_order``);
3. compute ``token_weights`` ONCE for the whole step (on the response tokens, canonical order),
   before any split: groups and sequences may then land in different microbatches, DP ranks or
   CP shards and the objective stays exact (``step_weights``);
4. assign whole sequences (attention needs them whole) to DP x microbatch bins, token-balanced
   (longest-first onto the lightest bin) (``pack_bins``);
5. build the packed THD layout directly in bin order (each bin a contiguous slice, with
   cu_seqlens and cu_seqlens_padded) and, with CP, only this CP rank's positions (Megatron's
   layout, :mod:`megatron_pg_agg.core.context_parallel`). Every per-token field is one gather
   (``token_layout``);
6. cut the layout into microbatches, check their capacity, pad them where asked
   (``assemble_microbatches``).

Token positions: a sequence is ``prompt + response``; position t predicts token t+1, so response
token j (sequence index P + j) is scored at position P + j - 1, where its mask, advantage and
log-probs are placed. The last position and padding score nothing.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from megatron_pg_agg.core import rollout_correction as engine_correction
from megatron_pg_agg.core.aggregation import TokenWeights, token_weights
from megatron_pg_agg.core.context_parallel import cp_partition_index
from megatron_pg_agg.core.losses import PGLossConfig, StepTotals
from megatron_pg_agg.core.segments import exclusive_cumsum, running_sums, segment_ids

from .rollouts import PlanError, RolloutBatch


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
    token_weights: TokenWeights  # [T]: the aggregation weights (c_t, k_t), sliced from the step's
    cu_seqlens: torch.Tensor  # int32 [S+1]: real sequence lengths
    cu_seqlens_padded: torch.Tensor  # int32 [S+1]: padded lengths (token offsets in this batch)
    max_seqlen: int
    sequence_ids: list  # canonical indices of the sequences packed here
    cu_seqlens_local: Optional[torch.Tensor] = None  # int32 [S+1]: this CP rank's share of each sequence
    seq_numerator_tokens: Optional[torch.Tensor] = None  # float32 [S]: N_i over all CP ranks
    correction_weights: Optional[torch.Tensor] = None  # float32 [T]: rollout-correction weight of pg_t

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    def _map(self, fn) -> "Microbatch":
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = fn(value)
            elif isinstance(value, TokenWeights):
                value = TokenWeights(fn(value.coef), fn(value.count), value.mode)
            elif isinstance(value, dict):
                value = {k: fn(v) for k, v in value.items()}
            moved[f.name] = value
        return Microbatch(**moved)

    def to(self, device) -> "Microbatch":
        """Every tensor on ``device`` with ``non_blocking`` copies (asynchronous from pinned memory:
        see :meth:`pin_memory`)."""
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> "Microbatch":
        """A copy in page-locked host memory, so that :meth:`to` a GPU does not block the host."""
        return self._map(lambda t: t.pin_memory())


@dataclass
class StepPlan:
    """Every DP rank's microbatches for one step, and the step's global numbers."""

    microbatches: list  # [dp_rank][microbatch] -> Microbatch
    totals: StepTotals
    group_sizes: list
    bin_tokens: list  # [dp_rank][microbatch] -> padded tokens (before any CP split)
    stats: dict = field(default_factory=dict)
    correction_stats: Optional[dict] = None
    """With a rollout correction: the step's ``{name: (sum, count)}`` host sums over every token of
    the step, for the keys of :data:`~megatron_pg_agg.core.losses.CORRECTION_REPORT_KEYS` (tokens
    masked and truncated over valid tokens, the mean weight over numerator tokens); None without."""

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
    microbatch_tokens: Optional[int] = None
    """Pad every microbatch to exactly this many tokens (before the CP split), as Megatron-LM's
    pipeline p2p buffers have the fixed shape ``--seq-length``; a microbatch that would hold more
    is a PlanError. Also the capacity when ``max_tokens_per_microbatch`` is None."""

    @property
    def capacity(self) -> Optional[int]:
        """Most padded tokens one microbatch may hold (None: unbounded)."""
        caps = [c for c in (self.max_tokens_per_microbatch, self.microbatch_tokens) if c is not None]
        return min(caps) if caps else None

    @property
    def pad_multiple(self) -> int:
        tp = self.tp_size if self.sequence_parallel else 1
        cp = 2 * self.cp_size if self.cp_size > 1 else 1
        return tp * cp // math.gcd(tp, cp)


def padded_lengths(batch: RolloutBatch, plan_cfg: PlanConfig, *, step=None) -> torch.Tensor:
    """int64 ``[N]``: each rollout's prompt + response length, padded to ``plan_cfg.pad_multiple``.

    Raises PlanError naming the first rollout too long for one microbatch (attention needs a
    sequence whole, so it can never be split to fit)."""
    multiple = plan_cfg.pad_multiple
    length = batch.prompt_lengths + batch.response_lengths
    padded = (length + multiple - 1) // multiple * multiple
    cap = plan_cfg.capacity
    if cap is not None and bool((padded > cap).any()):
        i = int((padded > cap).int().argmax())
        label = batch.group_labels[int(batch.group_index[i])] if batch.group_labels else int(batch.group_index[i])
        where = "" if step is None else f"step {step}, "
        raise PlanError(
            f"{where}rollout {i} (group {label!r}): {int(length[i])} tokens (prompt "
            f"{int(batch.prompt_lengths[i])} + response {int(batch.response_lengths[i])}, padded to "
            f"{int(padded[i])}) do not fit a microbatch of {cap} tokens; raise the capacity "
            "(max_tokens_per_microbatch, or Megatron-LM's --seq-length) or drop the sequence")
    return padded


def _lpt_bins(lengths: list, num_bins: int) -> list:
    """Longest-first onto the lightest bin; ties broken by index, so the result is deterministic."""
    # The heap holds each bin's (load, bin) as the one int load * num_bins + bin: the same order as
    # the pair (bin < num_bins), and ints compare and allocate faster than tuples. The stable sort
    # keeps equal lengths in index order, also with reverse=True, without a tuple key per sequence.
    heap = list(range(num_bins))
    bins = [[] for _ in range(num_bins)]
    for idx in sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True):
        key = heap[0]  # the lightest bin
        bins[key % num_bins].append(idx)
        heapq.heapreplace(heap, key + lengths[idx] * num_bins)
    return [sorted(b) for b in bins]


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


def plan_step(
    rollouts,
    loss_cfg: PGLossConfig,
    plan_cfg: PlanConfig,
    *,
    cp_rank: int = 0,
) -> StepPlan:
    """Plan one optimizer step: the phases of the module docstring, in order.

    ``rollouts`` is a list of :class:`Rollout` or a :class:`RolloutBatch` (the fast path for big
    steps); ``loss_cfg`` a :class:`~megatron_pg_agg.core.losses.PGLossConfig` (mode, divisor, whether
    reference log-probs are needed, policy loss and rollout correction). Microbatch ``m`` of DP
    rank ``r`` is bin ``m * dp + r``.
    """
    batch, correction = checked_batch(rollouts, loss_cfg, plan_cfg)
    order = canonical_order(batch, plan_cfg)
    weights = step_weights(batch, order, loss_cfg)
    bins = pack_bins(order, plan_cfg)
    layout = token_layout(batch, order, weights, bins, correction, plan_cfg, cp_rank)
    plan = assemble_microbatches(batch, order, weights, bins, layout, plan_cfg)
    if correction is not None:
        plan.correction_stats = engine_correction.correction_stats(batch.loss_mask, correction)
    return plan


# ----------------------------------------------------------------------------- the phases


def checked_batch(rollouts, loss_cfg: PGLossConfig, plan_cfg: PlanConfig):
    """1. The step as a checked :class:`RolloutBatch`, with the rollout correction applied to its
    numerator; returns ``(batch, correction or None)``. A RolloutBatch checked itself when it was
    built (``RolloutBatch.__post_init__``) and is trusted here: only a list of Rollout is packed
    and checked. Token ids are checked against ``plan_cfg.vocab_size`` when it is set."""
    if isinstance(rollouts, RolloutBatch):
        batch = rollouts  # valid by construction: re-checking it every plan would cost O(tokens)
        if plan_cfg.vocab_size is not None:
            batch.check_vocabulary(plan_cfg.vocab_size)
    else:
        batch = RolloutBatch.from_rollouts(rollouts, vocab_size=plan_cfg.vocab_size)
    require_inputs(batch, loss_cfg)
    correction = rollout_correction(batch, loss_cfg)
    if correction is not None:  # masked tokens leave the numerator (they keep the denominator)
        # a narrowed numerator keeps the batch valid: no constructor (and no re-check) per plan
        batch = batch.with_numerator_mask(correction.numerator_mask)
    return batch, correction


@dataclass(frozen=True)
class CanonicalOrder:
    """Phase 2's result: rollouts in canonical order (groups consecutive) and their lengths."""

    order: torch.Tensor
    """int64 ``[N]``: rollout index at each canonical position."""
    group_sizes: list
    """Sizes of the prompt groups, in canonical order."""
    padded: torch.Tensor
    """int64 ``[N]``: padded length of each rollout (original order)."""
    length: torch.Tensor
    """int64 ``[N]``: prompt + response length of each rollout (original order)."""
    p_start: torch.Tensor
    """int64 ``[N+1]``: offsets of the prompts in ``batch.prompt_tokens``."""
    r_start: torch.Tensor
    """int64 ``[N+1]``: offsets of the responses in the response-token arrays."""
    identity: bool = False
    """The rollouts are already in canonical order (``order`` is ``0..N-1``: groups arrive
    consecutive, the usual case), so response tokens need no reordering for the weights."""


def canonical_order(batch: RolloutBatch, plan_cfg: PlanConfig) -> CanonicalOrder:
    """2. Groups consecutive (in order of first appearance), every sequence padded to what
    sequence parallelism and 2 x CP need (a sequence too long for a microbatch is refused)."""
    order, group_sizes = _canonical_order(batch.group_index)
    return CanonicalOrder(order=order, group_sizes=group_sizes, padded=padded_lengths(batch, plan_cfg),
                          length=batch.prompt_lengths + batch.response_lengths,
                          p_start=exclusive_cumsum(batch.prompt_lengths),
                          r_start=exclusive_cumsum(batch.response_lengths),
                          identity=bool((order == torch.arange(order.numel())).all()))


def _index_dtype(largest: int) -> torch.dtype:
    """int32 for per-token indexes whenever the values fit: half the bytes of int64 per pass, and
    ``index_select`` takes either (the planner is memory-bound)."""
    return torch.int32 if largest < 2**31 else torch.long


def _ramps(starts: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, total: int,
           dtype: torch.dtype) -> torch.Tensor:
    """``[total]`` of ``dtype``: run ``k`` (positions ``starts[k]`` to ``starts[k] + lengths[k] - 1``;
    runs in position order, covering ``[0, total)``; empty runs allowed) holds ``values[k]``,
    ``values[k] + 1``, ... .

    A running sum of ones with each run's jump placed at its start: one scatter of K values and
    one cumsum, three light passes, where a gather of per-run bases by per-position run ids (a
    :func:`segment_ids`, a gather and an add) takes several heavier ones."""
    if not bool((lengths > 0).all()):
        keep = lengths > 0
        starts, values, lengths = starts[keep], values[keep], lengths[keep]
    ends = values + lengths - 1  # the value at each run's last position
    jumps = values - torch.cat([ends.new_zeros(1), ends[:-1]])  # first run: from the empty sum, 0
    steps = torch.ones(total, dtype=dtype)
    steps[starts] = jumps.to(dtype)
    return steps.cumsum_(0)


def _with_sentinel(values: Optional[torch.Tensor], sentinel=0) -> Optional[torch.Tensor]:
    """``values`` and one more entry, ``sentinel``: what a position that reads nothing reads."""
    return None if values is None else torch.cat([values, values.new_full((1,), sentinel)])


@dataclass(frozen=True)
class StepWeights:
    """Phase 3's result: the step's token weights and masks on the response tokens, each with one
    "nothing" entry appended (index ``r_total``), where phase 5 reads for the positions that score
    no response token."""

    weights: TokenWeights
    """``[R+1]``: computed in canonical order but stored in rollout order (the order of the
    response-token arrays), so the layout reads them with the same index as the other fields;
    0 at the end."""
    totals: StepTotals
    r_total: int
    """Response tokens of the step (R)."""
    denominator: torch.Tensor
    """bool ``[R+1]``: the loss mask, False at the end."""
    numerator: torch.Tensor
    """bool ``[R+1]``: the numerator mask (``denominator`` itself without filtering), False at the end."""


def step_weights(batch: RolloutBatch, order: CanonicalOrder, loss_cfg: PGLossConfig) -> StepWeights:
    """3. ``token_weights`` ONCE for the whole step, before any split. They depend only on the
    masks of the response tokens, so they are computed on those alone (canonical order: groups
    consecutive), not on the padded layout; every microbatch, rank and CP shard then gathers its
    tokens' weights. When the rollouts already are in canonical order (the usual case) the masks
    are used as they are; otherwise they are gathered into canonical order and the weights
    gathered back.

    The masks carry their "nothing" entry into ``token_weights`` as one more unit (a one-token
    sequence, its own prompt group) with no valid token: an inactive unit, whose weights are 0
    and which changes no other unit's, so the weights come out with their "nothing" entry
    without a copy of each."""
    mode, divisor = loss_cfg.mode, loss_cfg.divisor  # resolved where the config was built
    r_total = int(order.r_start[-1])
    den = _with_sentinel(batch.loss_mask, False)
    num = den if batch.numerator_mask is None else _with_sentinel(batch.numerator_mask, False)
    group_sizes = [*order.group_sizes, 1]
    if order.identity:
        cu_seqlens = torch.cat([order.r_start, order.r_start.new_full((1,), r_total + 1)])
        weights = token_weights(num, mode=mode, divisor=divisor, cu_seqlens=cu_seqlens,
                                group_sizes=group_sizes, denominator_mask=den, validate=False)
    else:
        one = order.r_start.new_ones(1)
        lengths = torch.cat([batch.response_lengths[order.order], one])  # canonical, and the extra unit
        rc_start = exclusive_cumsum(lengths)  # canonical response offsets
        rc_of_rollout = torch.empty_like(rc_start[:-1])
        rc_of_rollout[torch.cat([order.order, one * len(batch)])] = rc_start[:-1]
        dtype = _index_dtype(r_total + 1)
        # canonical position -> rollout-order token, and back (a run per rollout; the extra unit last)
        to_rollout = _ramps(rc_start[:-1], torch.cat([order.r_start[:-1][order.order], one * r_total]),
                            lengths, r_total + 1, dtype)
        to_canonical = _ramps(order.r_start, rc_of_rollout, torch.cat([batch.response_lengths, one]),
                              r_total + 1, dtype)
        den_c = den.index_select(0, to_rollout)
        num_c = den_c if num is den else num.index_select(0, to_rollout)
        canonical = token_weights(num_c, mode=mode, divisor=divisor, cu_seqlens=rc_start,
                                  group_sizes=group_sizes, denominator_mask=den_c, validate=False)
        weights = TokenWeights(canonical.coef.index_select(0, to_canonical),
                               canonical.count.index_select(0, to_canonical), canonical.mode)
    totals = StepTotals(pg_weight=int(weights.count.sum()), valid_tokens=int(torch.count_nonzero(den)))
    return StepWeights(weights, totals, r_total, den, num)


@dataclass(frozen=True)
class Bins:
    """Phase 4's result: the DP x microbatch bins (canonical sequence indices in each)."""

    members: list
    """``[bin] -> [canonical sequence index]``; bin ``b`` is DP rank ``b % dp``, microbatch ``b // dp``."""
    num_microbatches: int
    rollout_of: torch.Tensor
    """int64: the rollout index of each sequence in bin order (bins contiguous)."""


def pack_bins(order: CanonicalOrder, plan_cfg: PlanConfig) -> Bins:
    """4. Whole sequences (attention needs them whole) onto token-balanced bins: longest first
    onto the lightest bin, ties by index (deterministic)."""
    dp = plan_cfg.dp_size
    padded_canonical = order.padded[order.order].tolist()
    num_mb, bins = _choose_microbatches(padded_canonical, plan_cfg)
    empty = sum(1 for members in bins if not members)
    if empty:
        raise PlanError(
            f"{len(padded_canonical)} sequences cannot fill {dp} DP ranks x {num_mb} microbatches: "
            f"{empty} microbatches would be empty; use fewer microbatches or a larger step")
    rollout_of = order.order[torch.tensor([s for members in bins for s in members], dtype=torch.long)]
    return Bins(bins, num_mb, rollout_of)


@dataclass(frozen=True)
class TokenLayout:
    """Phase 5's result: every per-token field of this CP rank, bins contiguous, bin order."""

    fields: dict
    """Name -> per-token tensor (or None): tokens, labels, position_ids, masks, advantages,
    log-probs, and with a correction its weights and masked/truncated flags."""
    weights: TokenWeights
    seq_padded: torch.Tensor
    """int64: padded length of each sequence in bin order."""
    total: int
    """Padded tokens of the step (before the CP split)."""


def token_layout(batch: RolloutBatch, order: CanonicalOrder, step: StepWeights, bins: Bins, correction,
                 plan_cfg: PlanConfig, cp_rank: int) -> TokenLayout:
    """5. The packed THD layout directly in bin order and, with CP, only this CP rank's positions
    (Megatron's layout, :mod:`megatron_pg_agg.core.context_parallel`). Every per-token field is one
    gather (see the comments: planning is memory-bound, so passes count)."""
    rollout_of, r_total = bins.rollout_of, step.r_total
    seq_padded = order.padded[rollout_of]
    seq_offsets = exclusive_cumsum(seq_padded)
    total = int(seq_offsets[-1])
    cp = plan_cfg.cp_size
    seq_start, seq_last = seq_offsets[:-1], seq_offsets[1:] - 1
    prompt, length = batch.prompt_lengths[rollout_of], order.length[rollout_of]
    # Every token id is read from ONE source: the responses, then a block of zeros (padding, and
    # "nothing": a sequence's padding is shorter than the block), then the prompts. A sequence is
    # then three runs of consecutive source indexes (prompt, response, padding), so the index of
    # every position is one _ramps. Responses first, so the index of the next position, capped at
    # r_total, is the scored response token (position P + j - 1 scores response token j): a next
    # position in the padding or in another sequence's prompt lands at or past r_total, the
    # "nothing" sentinel appended to every response-token field. No per-position sequence ids,
    # bases or torch.where (each a pass over the step's positions).
    zeros = plan_cfg.pad_multiple
    p_total = batch.prompt_tokens.numel()
    dtype = _index_dtype(r_total + zeros + p_total)
    source = torch.cat([batch.response_tokens, batch.response_tokens.new_zeros(zeros), batch.prompt_tokens])
    runs = torch.stack([
        torch.stack([seq_start, seq_start + prompt, seq_start + length], 1),        # starts
        torch.stack([r_total + zeros + order.p_start[rollout_of], order.r_start[rollout_of],
                     torch.full_like(prompt, r_total)], 1),                          # first source index
        torch.stack([prompt, length - prompt, seq_padded - length], 1),              # lengths
    ]).reshape(3, -1)
    at = _ramps(*runs, total, dtype)
    position_ids = _ramps(seq_start, torch.zeros_like(seq_start), seq_padded, total, torch.long)
    following = torch.empty_like(at)  # the source index of the next position of the same sequence
    if cp > 1:
        following[:-1] = at[1:]
        following[seq_last] = r_total  # (a zero) after each sequence's last position
        kept = cp_partition_index(seq_padded, cp, cp_rank)
        at, following, position_ids = (t.index_select(0, kept) for t in (at, following, position_ids))
        tokens, labels = source.index_select(0, at), source.index_select(0, following)
        scored = following.clamp_max_(r_total)
    else:  # sequences are contiguous: the labels are the tokens shifted, 0 after each sequence
        tokens = source.index_select(0, at)
        labels = torch.empty_like(tokens)
        labels[:-1] = tokens[1:]
        labels[seq_last] = 0
        scored = following  # clamped as it is shifted: one pass
        torch.clamp(at[1:], max=r_total, out=scored[:-1])
        scored[seq_last] = r_total
    # scored: the response token scored at each position, or r_total (nothing)
    del source, at  # freed now, so that the fields below can reuse their memory

    def read(values, index, sentinel=0):
        return None if values is None else _with_sentinel(values, sentinel).index_select(0, index)

    if step.numerator is step.denominator:
        den = num = step.denominator.index_select(0, scored)
    else:  # one gather for both masks: bit 0 the denominator, bit 1 the numerator (0/1 bytes are bools)
        both = (step.numerator.view(torch.uint8) << 1).bitwise_or_(step.denominator.view(torch.uint8))
        both = both.index_select(0, scored)
        den, num = (both & 1).view(torch.bool), (both >> 1).view(torch.bool)
        del both
    # The weights need no mask: token_weights leaves c_t and k_t at 0 outside the numerator and
    # the denominator (the numerator is within the denominator), as at the "nothing" entry.
    weights = TokenWeights(step.weights.coef.index_select(0, scored), step.weights.count.index_select(0, scored),
                           step.weights.mode)
    correction_weights = None if correction is None else read(correction.weights, scored, 1)
    # where(den, scored, r_total), in place and as arithmetic (faster than torch.where on CPU):
    # masked positions read the "nothing" 0, never the values stored there (which may be NaN)
    valid = scored.sub_(r_total).mul_(den).add_(r_total)
    fields = {
        "tokens": tokens, "labels": labels, "position_ids": position_ids,
        "numerator_mask": num, "denominator_mask": den,
        "advantages": read(batch.advantages, valid),
        "old_logprobs": read(batch.old_logprobs, valid),
        "ref_logprobs": read(batch.ref_logprobs, valid),
    }
    if correction is not None:
        fields["correction_weights"] = correction_weights
    return TokenLayout(fields, weights, seq_padded, total)


@dataclass(frozen=True)
class _HostLists:
    """Per packed sequence (bin order), as host lists: what every microbatch takes a run of."""

    padded: list
    """Padded length of each sequence."""
    real: list
    """Prompt + response length of each sequence."""
    numerator_tokens: list
    """N_i: numerator tokens of each sequence (over all CP ranks)."""
    rollout: list
    """Index of each sequence's rollout in the step (original order)."""


def _microbatch(layout: TokenLayout, hosts: _HostLists, here: slice, part: slice, extra: int, cp: int) -> Microbatch:
    """One bin as a Microbatch: the token slice ``part`` of every per-token tensor (this CP rank's
    share), the sequences ``here`` of the host lists, ``extra`` padding tokens appended to the last
    sequence (they score nothing)."""
    cut = {k: (None if v is None else v[part]) for k, v in layout.fields.items()}
    w = layout.weights[part]
    seq_pad = hosts.padded[here]
    if extra:
        seq_pad[-1] += extra
        cut = {k: (None if v is None else torch.cat([v, v.new_zeros(extra)])) for k, v in cut.items()}
        w = TokenWeights.cat([w, TokenWeights(w.coef.new_zeros(extra), w.count.new_zeros(extra), w.mode)])
    cu_padded = torch.tensor([0, *running_sums(seq_pad)], dtype=torch.int32)
    return Microbatch(
        tokens=cut["tokens"].unsqueeze(0),
        labels=cut["labels"].unsqueeze(0),
        position_ids=cut["position_ids"].unsqueeze(0),
        numerator_mask=cut["numerator_mask"],
        denominator_mask=cut["denominator_mask"],
        advantages=cut["advantages"],
        old_logprobs=cut["old_logprobs"],
        ref_logprobs=cut["ref_logprobs"],
        token_weights=w,
        cu_seqlens=torch.tensor([0, *running_sums(hosts.real[here])], dtype=torch.int32),
        cu_seqlens_padded=cu_padded,
        max_seqlen=max(seq_pad),
        sequence_ids=hosts.rollout[here],
        cu_seqlens_local=cu_padded // cp,
        seq_numerator_tokens=torch.tensor(hosts.numerator_tokens[here], dtype=torch.float32),
        correction_weights=cut.get("correction_weights"),
    )


def assemble_microbatches(batch: RolloutBatch, order: CanonicalOrder, step: StepWeights, bins: Bins,
                          layout: TokenLayout, plan_cfg: PlanConfig) -> StepPlan:
    """6. Each bin a slice of every per-token tensor and a run of the host lists (computed once),
    checked against the microbatch capacity and, where asked, padded to one length."""
    dp, cp, num_mb = plan_cfg.dp_size, plan_cfg.cp_size, bins.num_microbatches
    rollout_of = bins.rollout_of
    seq_pad_all = layout.seq_padded.tolist()
    # N_i from int32 prefix counts of the numerator at the response offsets: exact integer counts,
    # as the float32 per-token sum they replace (no response comes near 2**24 tokens)
    prefix = exclusive_cumsum(batch.loss_mask if batch.numerator_mask is None else batch.numerator_mask,
                              torch.int32)
    numerator_per_rollout = (prefix[order.r_start[1:]] - prefix[order.r_start[:-1]]).float()
    seq_num_all = numerator_per_rollout[rollout_of].tolist()
    members_of = bins.members
    bin_sizes = [sum(seq_pad_all[k] for k in range(first, first + len(members)))
                 for first, members in zip(running_sums([0] + [len(m) for m in members_of])[:-1], members_of)]
    if plan_cfg.capacity is not None and max(bin_sizes) > plan_cfg.capacity:
        b = max(range(len(members_of)), key=lambda k: bin_sizes[k])
        raise PlanError(
            f"{len(batch)} sequences ({layout.total} padded tokens) do not fit {dp} DP ranks x {num_mb} "
            f"microbatches of {plan_cfg.capacity} tokens: microbatch {b // dp} of DP rank {b % dp} "
            f"would hold {bin_sizes[b]}; use more microbatches (a larger global batch) or a larger "
            "capacity (--seq-length)")
    if plan_cfg.microbatch_tokens is not None:
        uniform = plan_cfg.microbatch_tokens
    else:
        uniform = max(bin_sizes) if plan_cfg.uniform_microbatch_tokens else None
    hosts = _HostLists(seq_pad_all, order.length[rollout_of].tolist(), seq_num_all, rollout_of.tolist())
    microbatches = [[None] * num_mb for _ in range(dp)]
    bin_tokens = [[0] * num_mb for _ in range(dp)]
    start, first = 0, 0
    for b, members in enumerate(members_of):
        rank, mb = b % dp, b // dp
        here = slice(first, first + len(members))
        first += len(members)
        size = bin_sizes[b]
        bin_tokens[rank][mb] = size
        extra = uniform - size if uniform is not None else 0
        if extra and cp > 1:
            raise PlanError("padding microbatches to one length with cp_size > 1 is not supported: the extra "
                            "padding would not follow the CP chunk layout")
        microbatches[rank][mb] = _microbatch(layout, hosts, here, slice(start // cp, (start + size) // cp),
                                             extra, cp)
        start += size
    flat = [t for row in bin_tokens for t in row]
    per_rank = [sum(row) for row in bin_tokens]
    stats = {
        "sequences": len(batch),
        "groups": len(order.group_sizes),
        "tokens": int(order.length.sum()),
        "padded_tokens": layout.total,
        "microbatches_per_rank": num_mb,
        "microbatch_balance": max(flat) / (sum(flat) / len(flat)),
        "rank_balance": max(per_rank) / (sum(per_rank) / len(per_rank)),
        "pg_weight": step.totals.pg_weight,
        "valid_tokens": step.totals.valid_tokens,
    }
    return StepPlan(microbatches, step.totals, order.group_sizes, bin_tokens, stats)


def require_inputs(batch: RolloutBatch, loss_cfg: PGLossConfig) -> None:
    """The per-token inputs the loss config needs are in the data (a PlanError names the flag)."""
    if loss_cfg.needs_reference and batch.ref_logprobs is None:
        raise PlanError("ref_logprobs is missing (on at least one rollout) but kl_coef > 0 needs it")
    if loss_cfg.rollout_correction and batch.rollout_logprobs is None:
        raise PlanError(f"rollout_logprobs is missing (on at least one rollout) but the rollout correction "
                        f"{loss_cfg.rollout_correction!r} needs it: add the rollout engine's log-probs to "
                        "the rollouts, or drop --pg-rollout-correction")


def policy_loss_notes(batches: dict, loss_cfg: PGLossConfig) -> list:
    """What a user should read once at start-up about the policy loss on these rollout steps
    (``{step: RolloutBatch}``): GSPO is the paper's objective only under seq_mean (other modes
    weight each sequence's term by its length), and its sequence ratio assumes one advantage
    per sequence (token-level advantages are used as given, and reported)."""
    if loss_cfg.policy_loss != "gspo":
        return []
    notes = []
    if loss_cfg.mode != "seq_mean":
        notes.append(f"gspo with --pg-loss-aggregation {loss_cfg.mode}: each sequence's GSPO term is "
                     "weighted by its length; the paper's GSPO (value and gradient) is gspo under seq_mean")
    varying = total = 0
    for batch in batches.values():
        r_start = exclusive_cumsum(batch.response_lengths)
        owner = segment_ids(r_start, int(r_start[-1]))
        adv = batch.advantages.double()
        big = torch.finfo(torch.float64).max
        low = torch.full((len(batch),), big, dtype=torch.float64).scatter_reduce(
            0, owner, torch.where(batch.loss_mask, adv, big), reduce="amin")
        high = torch.full((len(batch),), -big, dtype=torch.float64).scatter_reduce(
            0, owner, torch.where(batch.loss_mask, adv, -big), reduce="amax")
        varying += int(((high - low) > 1e-6).sum())
        total += len(batch)
    if varying:
        notes.append(f"gspo: advantages vary within {varying} of {total} sequences; GSPO's sequence ratio "
                     "assumes one advantage per sequence (token-level advantages are used as given)")
    return notes


def rollout_correction(batch: RolloutBatch, loss_cfg: PGLossConfig) -> Optional[engine_correction.RolloutCorrection]:
    """:func:`megatron_pg_agg.core.rollout_correction.rollout_correction` on a batch's response
    tokens (None when ``loss_cfg`` asks for none)."""
    return engine_correction.rollout_correction(
        batch.loss_mask, batch.old_logprobs, batch.rollout_logprobs, batch.response_lengths, loss_cfg,
        numerator_mask=batch.numerator_mask)


def _choose_microbatches(padded: list, cfg: PlanConfig) -> tuple:
    """``(microbatches per DP rank, LPT bins)``: the configured count, else the fewest whose LPT
    assignment fits the capacity (the bins of the last try are the answer: not computed twice)."""
    if cfg.num_microbatches is not None:
        if cfg.num_microbatches < 1:
            raise PlanError(f"num_microbatches must be >= 1; got {cfg.num_microbatches}")
        return cfg.num_microbatches, _lpt_bins(padded, cfg.dp_size * cfg.num_microbatches)
    cap = cfg.capacity
    if cap is None:
        return 1, _lpt_bins(padded, cfg.dp_size)
    num_mb = max(1, -(-sum(padded) // (cfg.dp_size * cap)))
    while True:  # LPT may overflow a bin that a perfect packing would not: add microbatches
        bins = _lpt_bins(padded, cfg.dp_size * num_mb)
        if max(sum(padded[i] for i in b) for b in bins) <= cap:
            return num_mb, bins
        num_mb += 1
