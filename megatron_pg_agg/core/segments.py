"""Segment arithmetic on packed sequences: offsets from lengths, and which segment holds a position.

A step is packed as runs of tokens (responses, sequences, prompt groups, CP chunks) described by
``offsets`` (``[K+1]``, starting at 0). The aggregation, the rollout checks, the planner, the CP
layout, the THD attention mask and the sequence statistic of the policy losses all use these,
so each is written once. Vectorised; none reads device data on the host.
"""
from __future__ import annotations

import torch

__all__ = ["exclusive_cumsum", "running_sums", "segment_ids", "segment_of"]


def exclusive_cumsum(values: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``[K+1]`` running sums starting at 0 (segment lengths -> offsets), on ``values``' device."""
    out = torch.zeros(values.numel() + 1, dtype=dtype, device=values.device)
    torch.cumsum(values, 0, dtype=dtype, out=out[1:])
    return out


def segment_ids(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``[total]``: for each position, the index of the segment ``[offsets[k], offsets[k+1])``
    holding it (``offsets`` starts at 0 and ends at ``total``; empty segments allowed).

    Same result as ``repeat_interleave(arange(K), diff(offsets), output_size=total)``, but a
    scatter of segment starts and an int32 running sum is several times faster on CPU, and, like
    it, needs no device data on the host (the shape is ``total``)."""
    marks = torch.zeros(total + 1, dtype=torch.int32, device=offsets.device)
    starts = offsets[1:-1]
    marks.index_put_((starts,), torch.ones_like(starts, dtype=torch.int32), accumulate=True)
    return torch.cumsum(marks[:total], 0, dtype=torch.int32).long()


def segment_of(offsets: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64: the segment holding each of ``positions`` (any order, any subset); a position at or
    past ``offsets[-1]`` maps to one past the last segment. For sparse or reordered positions,
    where :func:`segment_ids` (every position, in order) does not apply."""
    return torch.searchsorted(offsets[1:].to(torch.long).contiguous(), positions, right=True)


def running_sums(values: list) -> list:
    """Inclusive running sums of a host list (``[1, 2, 3] -> [1, 3, 6]``)."""
    out, acc = [], 0
    for v in values:
        acc += v
        out.append(acc)
    return out
