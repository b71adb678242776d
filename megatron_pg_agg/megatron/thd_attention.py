"""Core attention for packed THD sequences without Transformer Engine (the CPU stand-in).

WHY
    Megatron-LM packs RL rollouts as THD (micro-batch size 1, sequences back to back, boundaries
    in ``PackedSeqParams.cu_seqlens_*``). Only TE's ``TEDotProductAttention`` honours those
    boundaries; the local ``DotProductAttention`` asserts ``packed_seq_params is None``. Without a
    THD-aware core attention, a CPU run either crashes or lets packed sequences attend to each
    other, and no CPU test of the packed loss path would mean anything.

WHAT
    :class:`ThdDotProductAttention` subclasses the local ``DotProductAttention`` (same constructor,
    so it drops into ``spec.submodules.self_attention.submodules.core_attention`` of
    ``get_gpt_layer_local_spec()``) and only builds a mask: for THD input it is block-diagonal
    (one block per packed sequence, from ``cu_seqlens_q_padded``, else ``cu_seqlens_q``) and causal
    within each block; the upstream forward then does the attention itself (TP heads per
    partition, GQA, softmax, dropout, output ``[s, b, hidden/TP]``). Without packed params, and
    without a mask, it passes an explicit causal mask built on the input's device.

    The mask is built on device with ``searchsorted`` (no host read of ``cu_seqlens``), but it is
    O(t^2) in the pack length ``t``. So where ``max_seqlen_q`` (a host int bounding every block) makes
    it cheaper, ``(blocks + 1) x max_seqlen^2 < t^2``, the blocks are instead gathered into a padded
    batch ``[max_seqlen, blocks, heads, d]``, upstream's forward runs on it with each block's own
    causal mask, and each token's output is gathered back: the same scores and softmax rows (their
    masked entries are exact zeros either way; float32 sums over another width), for a pack of many
    short sequences a fraction of the work (the main job's RL steps: 104 s of CPU -> 42 s for the
    whole job on 2 cores). It stays a CPU/test stand-in for TE's varlen kernel, not a fast path.
    Masked scores are filled with -10000 by upstream's ``attention_mask_func``; in fp32 their softmax
    weight underflows to exactly 0, so a pack matches its sequences run one by one.

    Padded layouts: with ``cu_seqlens_q_padded`` each block spans a sequence and its padding;
    the padding sits after the real tokens, so causality keeps it invisible to them (its own
    outputs are garbage that the loss mask drops; TE writes zeros there). Tokens after the last
    boundary, if any, form one more block. Context parallelism is not supported (the parent
    asserts ``context_parallel_size == 1``); THD with CP needs TE.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from megatron_pg_agg.core.segments import segment_of

__all__ = ["ThdDotProductAttention", "packed_attention_mask", "use_thd_core_attention"]

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


def packed_attention_mask(cu_seqlens: Tensor, total: int, *, causal: bool = True) -> Tensor:
    """``[1, 1, total, total]`` bool mask, True where attention is NOT allowed.

    Position ``i`` may attend to ``j`` iff both lie in the same block ``[cu[k], cu[k+1])``
    (positions at or after ``cu[-1]`` form one trailing block) and, if ``causal``, ``j <= i``.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got {tuple(cu_seqlens.shape)}")
    pos = torch.arange(total, device=cu_seqlens.device)
    block = segment_of(cu_seqlens, pos)
    masked = block[:, None] != block[None, :]
    if causal:
        masked = masked | (pos[None, :] > pos[:, None])
    return masked.view(1, 1, total, total)


def _causal_mask(sq: int, device: torch.device) -> Tensor:
    return torch.ones(sq, sq, dtype=torch.bool, device=device).triu(1).view(1, 1, sq, sq)


class ThdDotProductAttention(DotProductAttention):
    """Local ``DotProductAttention`` that also accepts packed THD batches (see module docstring)."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """``query/key/value``: ``[s, b, heads/TP, d]`` (or ``[t, heads/TP, d]`` for THD, as
        ``Attention`` squeezes them). Returns ``[s, b, hidden/TP]`` (``[t, hidden/TP]`` for THD
        input, like TE)."""
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in _CAUSAL
        # never megatron-core's fused softmax (the config's masked_softmax_fusion, on by default on
        # CUDA): for a causal layer its kernel applies its own upper-triangular mask and ignores the
        # one built here, so packed sequences would attend to each other; without apex its import
        # fails on bf16/fp16 shapes (a multiple of 4, at most 4096 keys). An instance attribute:
        # use_thd_core_attention switches the class of built modules, which runs no constructor
        self.scale_mask_softmax.scaled_masked_softmax_fusion = False
        if packed_seq_params is None:
            sq = query.size(0)
            if attention_mask is None and causal and sq > 1:
                if key.size(0) != sq:
                    raise ValueError("causal self-attention needs as many keys as queries")
                attention_mask = _causal_mask(sq, query.device)
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)

        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(
                f"ThdDotProductAttention handles qkv_format='thd' only, got "
                f"{packed_seq_params.qkv_format!r}"
            )
        squeezed = query.dim() == 3
        if squeezed:  # Attention.forward squeezes the dummy batch dim for THD
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if query.size(1) != 1:
            raise ValueError(f"packed THD input needs micro-batch size 1, got {query.size(1)}")
        if key.size(0) != query.size(0):
            raise ValueError("packed THD attention is self-attention: as many keys as queries")
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        if cu is None:
            raise ValueError("packed_seq_params has neither cu_seqlens_q_padded nor cu_seqlens_q")
        cu = cu.to(query.device)
        if self._padded_is_cheaper(packed_seq_params, cu, query.size(0), attention_mask, attention_bias):
            out = self._padded_forward(query, key, value, cu, packed_seq_params.max_seqlen_q, causal, attn_mask_type)
            return out if squeezed else out.unsqueeze(1)
        mask = packed_attention_mask(cu, query.size(0), causal=causal)
        if attention_mask is not None:
            mask = mask | attention_mask.to(torch.bool)
        out = super().forward(query, key, value, mask, attn_mask_type, attention_bias)
        return out.squeeze(1) if squeezed else out

    def _padded_is_cheaper(self, params: PackedSeqParams, cu: Tensor, total: int, attention_mask,
                           attention_bias) -> bool:
        """Whether the pack's blocks, as a padded batch, cost fewer scores than the block-diagonal mask:
        ``(blocks + 1) x max_seqlen^2 < t^2``, all host integers (``max_seqlen_q`` bounds every block, as
        TE's varlen kernel requires). Not with a further mask or bias, or attention dropout in training
        (its random draws follow the scores' shape), which the mask form keeps as upstream has them."""
        longest = params.max_seqlen_q
        if not isinstance(longest, int) or longest < 1 or attention_mask is not None or attention_bias is not None:
            return False
        if self.training and self.attention_dropout.p > 0:
            return False
        return cu.numel() * longest * longest < total * total

    def _padded_forward(self, query, key, value, cu: Tensor, longest: int, causal: bool, attn_mask_type) -> Tensor:
        """The same attention as the block-diagonal mask, with each block a row of a padded batch
        ``[longest, blocks, heads, d]`` (the tokens after ``cu[-1]``, if any, one more block): upstream's
        forward on that batch with a mask of each block's own keys (causal within it), then each token's
        output read back from its block and offset. Gathers only: no host read of ``cu``."""
        total = query.size(0)
        bounds = torch.cat([cu.long(), cu.new_full((1,), total).long()])  # the trailing block (empty if none)
        pos = torch.arange(longest, device=query.device)
        starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
        valid = pos[:, None] < lengths[None, :]  # [longest, blocks]
        rows = torch.where(valid, starts[None, :] + pos[:, None], total)  # padding reads an appended zero row

        def padded(x):  # [t, 1, heads, d] -> [longest, blocks, heads, d]
            return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[rows].squeeze(2)

        mask = ~valid.T[:, None, None, :]  # [blocks, 1, 1, longest]: keys past the block's end
        if causal:
            mask = mask | (pos[None, :] > pos[:, None])[None, None]
        out = DotProductAttention.forward(self, padded(query), padded(key), padded(value), mask, attn_mask_type, None)
        token = torch.arange(total, device=query.device)
        block = segment_of(cu, token)
        return out[token - bounds[block], block]  # [t, hidden/TP]


def use_thd_core_attention(model: torch.nn.Module) -> int:
    """Give every local-spec core attention of a built model packed-THD boundaries; returns how
    many were converted (0 with Transformer Engine's attention, which handles THD itself).

    Why the class of built instances: Megatron-LM's ``gpt_builder`` picks the layer spec from
    its flags (normalisation, QK layernorm, experts, ...) and offers no hook for the core
    attention but ``--spec``, a fixed object that would ignore those flags. The subclass adds no
    state and no parameter (it only builds the block-diagonal mask before the upstream forward),
    so switching the class of an exact ``DotProductAttention`` keeps everything the flags chose.
    """
    converted = 0
    for module in model.modules():
        if type(module) is DotProductAttention:
            module.__class__ = ThdDotProductAttention
            converted += 1
    return converted
