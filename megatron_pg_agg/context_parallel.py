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


def cp_partition_index(padded_lengths: Sequence[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """int64 positions (into the packed, padded microbatch) that CP rank ``cp_rank`` keeps."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}); got {cp_rank}")
    pieces, offset = [], 0
    for length in padded_lengths:
        if length % (2 * cp_size):
            raise ValueError(
                f"a padded sequence length ({length}) must be divisible by 2 * cp_size = "
                f"{2 * cp_size}; pad sequences with PlanConfig(cp_size=...)"
            )
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            start = offset + c * chunk
            pieces.append(torch.arange(start, start + chunk))
        offset += length
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
