"""Megatron's THD context-parallel layout, in pure torch (runs on CPU; no Transformer Engine).

Each padded sequence of length ``Lp`` (a multiple of ``2 * cp``) is cut into ``2 * cp`` equal
chunks; CP rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r`` (the causal-attention load
balance of TE's ``thd_get_partitioned_indices``, used by megatron-core's
``get_thd_batch_on_this_cp_rank``). Every per-token tensor, token weights included, is indexed
with the same positions, so the counts of a sequence are split, never duplicated, across CP ranks.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .segments import exclusive_cumsum, segment_ids


def cp_partition_index(padded_lengths: Sequence[int] | torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """int64 positions (into the packed, padded run of sequences) that CP rank ``cp_rank`` keeps,
    in order: for each sequence, its chunk ``cp_rank`` then its chunk ``2 * cp_size - 1 - cp_rank``.
    Vectorised (the planner calls it on whole steps)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}); got {cp_rank}")
    padded = torch.as_tensor(padded_lengths, dtype=torch.long).reshape(-1)
    bad = padded % (2 * cp_size) != 0
    if bool(bad.any()):
        length = int(padded[int(bad.int().argmax())])
        raise ValueError(
            f"a padded sequence length ({length}) must be divisible by 2 * cp_size = "
            f"{2 * cp_size}; pad sequences with PlanConfig(cp_size=...)"
        )
    chunk = padded // (2 * cp_size)
    starts = exclusive_cumsum(padded)[:-1]
    firsts = torch.stack([starts + cp_rank * chunk, starts + (2 * cp_size - 1 - cp_rank) * chunk], 1).reshape(-1)
    offsets = exclusive_cumsum(chunk.repeat_interleave(2))  # where each kept chunk lands
    total = int(offsets[-1])
    piece = segment_ids(offsets, total)
    return firsts[piece] + torch.arange(total) - offsets[piece]
