"""Test tooling: pack variable-length token sequences into one THD micro-batch (Megatron-LM's RL
layout). Training packs with the planner (megatron_pg_agg.data.planner); this simple packer builds the
THD inputs of the attention and smoke tests.

WHY
    Megatron-LM packs rollouts back to back with micro-batch size 1 and passes the boundaries as
    ``PackedSeqParams(qkv_format="thd", cu_seqlens_*)``. Tests and workers need the same layout
    on CPU, built one way everywhere, so that a packed forward can be compared with running each
    sequence alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

__all__ = ["PackedBatch", "next_token_targets", "pack_sequences"]


@dataclass(frozen=True)
class PackedBatch:
    tokens: Tensor
    """``[1, t]`` int64 token ids (padding slots hold ``pad_id``)."""
    position_ids: Tensor
    """``[1, t]`` positions restarting at 0 for each sequence (used by learned embeddings)."""
    packed_seq_params: PackedSeqParams
    lengths: tuple[int, ...]
    """Real (unpadded) length of each sequence."""
    offsets: tuple[int, ...]
    """Start of each sequence in the pack (padded layout)."""


def pack_sequences(
    seqs: Sequence[Tensor | Sequence[int]],
    *,
    pad_to_multiple: int = 1,
    pad_to_length: Optional[int] = None,
    pad_id: int = 0,
) -> PackedBatch:
    """Pack 1-D token sequences; each is right-padded to a multiple of ``pad_to_multiple``.

    ``pad_to_length`` then extends the last sequence's padding so the pack has exactly that many
    tokens (fixed-length micro-batches: pipelines without ``variable_seq_lengths``).
    ``cu_seqlens_q/kv`` hold the real cumulative lengths and ``cu_seqlens_*_padded`` the padded
    ones (equal without padding), int32 as TE expects.
    """
    if not seqs:
        raise ValueError("pack_sequences needs at least one sequence")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    parts, positions, lengths, padded = [], [], [], []
    for seq in seqs:
        seq = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
        n = seq.numel()
        if n == 0:
            raise ValueError("empty sequences cannot be packed")
        p = -(-n // pad_to_multiple) * pad_to_multiple
        parts.append(torch.cat([seq, seq.new_full((p - n,), pad_id)]))
        positions.append(torch.arange(p))
        lengths.append(n)
        padded.append(p)
    if pad_to_length is not None:
        extra = pad_to_length - sum(padded)
        if extra < 0:
            raise ValueError(f"{sum(padded)} packed tokens exceed pad_to_length={pad_to_length}")
        parts[-1] = torch.cat([parts[-1], parts[-1].new_full((extra,), pad_id)])
        positions[-1] = torch.arange(padded[-1] + extra)
        padded[-1] += extra

    def cumulative(xs: list[int]) -> Tensor:
        return torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32)

    cu, cu_padded = cumulative(lengths), cumulative(padded)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )
    return PackedBatch(
        tokens=torch.cat(parts).unsqueeze(0),
        position_ids=torch.cat(positions).unsqueeze(0),
        packed_seq_params=params,
        lengths=tuple(lengths),
        offsets=tuple(cu_padded[:-1].tolist()),
    )


def next_token_targets(batch: PackedBatch) -> tuple[Tensor, Tensor]:
    """``(labels, loss_mask)``, both ``[1, t]``: each real token predicts the next token of *its
    own* sequence; the last real token of every sequence and all padding get label ``0`` and
    mask ``0`` (a pack must never predict across a sequence boundary)."""
    tokens = batch.tokens[0]
    labels = torch.zeros_like(tokens)
    mask = torch.zeros(tokens.numel(), dtype=torch.float32)
    for off, n in zip(batch.offsets, batch.lengths):
        labels[off:off + n - 1] = tokens[off + 1:off + n]
        mask[off:off + n - 1] = 1.0
    return labels.unsqueeze(0), mask.unsqueeze(0)
