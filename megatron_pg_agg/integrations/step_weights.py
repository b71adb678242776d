"""The step's token weights over the optimizer-step batch of every DP rank, for the RL-framework
plug-ins (verl, AReaL) whose engine receives one step's batch per DP rank and cuts it into
micro-batches itself.

Each rank holds only its own rows. What the weights of its tokens depend on elsewhere is small: each
other row's count of valid tokens and, for prompt_mean, its prompt group. One
``all_gather_object`` over the DP group brings exactly that; :func:`global_layout` lays every
rank's rows out as one packed step (groups consecutive), and :func:`megatron_pg_agg.core.
aggregation.token_weights` (the same call as the planner's) gives ``c_t`` and ``W``:

    J = (1 / W) * sum_t c_t * pg_t        over the tokens of every rank and micro-batch.

Host tensors only: this runs once per optimizer step, before the split, never per micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_pg_agg.core.aggregation import token_weights
from megatron_pg_agg.core.segments import exclusive_cumsum

__all__ = ["StepWeights", "cut_groups", "dp_step_weights", "gather_over_dp", "global_layout"]


@dataclass(frozen=True)
class StepWeights:
    """One rank's share of a step's weights."""

    coef: torch.Tensor
    """float32 [this rank's tokens, row after row]: c_t (0 outside the numerator)."""
    pg_weight: int
    """W of the whole step (every DP rank): the objective's divisor."""
    valid_tokens: int
    """D: the step's valid (denominator) tokens on every DP rank."""


def cut_groups(steps: Sequence[Sequence[int]], group_ids: Sequence, rows: int, *,
               remainder: str = "the remainder the host drops") -> list:
    """The prompt groups a host's optimizer steps cut (prompt_mean needs each inside one step), as
    ``"group <id> over steps [...]"``: ``steps`` lists the row indices of each step, in order;
    ``group_ids`` one hashable per row (``rows`` of them); rows in no step are never trained and
    count as one more place, ``remainder``."""
    if group_ids is None or len(group_ids) != rows or any(g is None for g in group_ids):
        missing = rows if group_ids is None else sum(g is None for g in group_ids) + abs(len(group_ids) - rows)
        raise ValueError(f"prompt_mean needs one prompt group per row: {missing} of {rows} rows have none")
    places: dict = {}
    trained = set()
    for s, members in enumerate(steps):
        for i in members:
            places.setdefault(group_ids[i], set()).add(s)
            trained.add(i)
    for i in range(rows):
        if i not in trained and group_ids[i] in places:
            places[group_ids[i]].add(remainder)
    return [f"group {g} over steps {sorted(s, key=str)}" for g, s in places.items() if len(s) > 1]


def gather_over_dp(mine, dp_group=None) -> tuple:
    """``(every DP rank's mine, in rank order; this rank's index)``: one ``all_gather_object`` over
    ``dp_group`` (host objects), or just ``mine`` without a group of more than one rank."""
    if dp_group is not None and torch.distributed.get_world_size(dp_group) > 1:
        gathered = [None] * torch.distributed.get_world_size(dp_group)
        torch.distributed.all_gather_object(gathered, mine, group=dp_group)
        return gathered, torch.distributed.get_rank(dp_group)
    return [mine], 0


def dp_step_weights(mask: torch.Tensor, numerator: torch.Tensor, lengths: torch.Tensor,
                    group_ids: Optional[Sequence], *, mode: str, divisor: Optional[float],
                    dp_group=None) -> StepWeights:
    """The weights of this rank's tokens for a step cut over the DP ranks of ``dp_group``.
    ``mask``/``numerator``: bool [tokens] of this rank's rows laid end to end (``lengths`` each);
    ``group_ids``: one hashable per row, the prompt group (needed by prompt_mean; ids must differ
    between groups of different ranks), else None."""
    starts = exclusive_cumsum(lengths)
    prefix = exclusive_cumsum(mask.to(torch.int64))
    counts = (prefix[starts[1:]] - prefix[starts[:-1]]).tolist()  # host tensors: no device sync
    grouped = group_ids is not None
    gathered, rank = gather_over_dp((list(group_ids) if grouped else None, counts), dp_group)
    num_g, den_g, cu, group_sizes, local = global_layout(mask, numerator, lengths, gathered, rank, grouped)
    step = token_weights(num_g, mode=mode, divisor=divisor, cu_seqlens=cu, group_sizes=group_sizes,
                         denominator_mask=den_g)
    return StepWeights(step.coef[local], int(step.count.sum()), int(den_g.sum()))


def global_layout(local_mask: torch.Tensor, local_numerator: torch.Tensor, lengths: torch.Tensor,
                  gathered: list, rank: int, grouped: bool):
    """Every DP rank's rows in one packed layout, groups consecutive (in order of first
    appearance): this rank's rows with their real masks, the other ranks' rows as ``D_s`` valid
    tokens (the weights of this rank's tokens depend on nothing else of them). Returns
    ``(numerator, denominator, cu_seqlens, group_sizes or None, index of this rank's tokens in
    row order)``."""
    rows = [(uids[i] if grouped else None, r, i, d)
            for r, (uids, counts) in enumerate(gathered) for i, d in enumerate(counts)]
    group_sizes = None
    if grouped:
        first = {}
        for pos, row in enumerate(rows):
            first.setdefault(row[0], pos)
        rows.sort(key=lambda row: first[row[0]])  # stable: rank, then row, inside a group
        group_sizes = []
        for pos, row in enumerate(rows):
            if pos and rows[pos - 1][0] == row[0]:
                group_sizes[-1] += 1
            else:
                group_sizes.append(1)
    local_start = exclusive_cumsum(lengths)
    num_parts, den_parts, local_at = [], [], {}
    offset = 0
    for _, r, i, d in rows:
        if r == rank:
            a, b = int(local_start[i]), int(local_start[i + 1])
            den, num = local_mask[a:b], local_numerator[a:b]
            local_at[i] = torch.arange(offset, offset + (b - a))
        else:
            den = torch.arange(max(d, 1)) < d  # a row with no valid token keeps one (masked) place
            num = den
        num_parts.append(num)
        den_parts.append(den)
        offset += den.numel()
    cu = exclusive_cumsum(torch.tensor([p.numel() for p in den_parts], dtype=torch.int64))
    index = torch.cat([local_at[i] for i in range(len(lengths))]) if len(lengths) else torch.zeros(0, dtype=torch.int64)
    return torch.cat(num_parts), torch.cat(den_parts), cu, group_sizes, index
