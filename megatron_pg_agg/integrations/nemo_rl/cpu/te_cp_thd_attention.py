"""Context-parallel core attention for packed THD batches without Transformer Engine (a CPU stand-in
for ``TEDotProductAttention`` with ``context_parallel_size > 1``).

WHY
    NeMo-RL runs context parallelism only with sequence packing (``nemo_rl/models/megatron/setup.py:875-882``:
    "Sequence Packing must be enabled to use Context Parallelism with MCore"): it packs each sequence
    padded to a multiple of ``2 * cp`` and hands every CP rank its two load-balancing chunks of each
    sequence (``_pack_sequences_for_megatron``, ``data.py:960-1146``, via ``_get_tokens_on_this_cp_rank``),
    with the *global* ``cu_seqlens_padded`` in ``PackedSeqParams`` (``data.py:1128-1137``). Only TE's
    attention takes that layout; megatron-core's local ``DotProductAttention`` refuses CP in its
    constructor (``megatron/core/transformer/dot_product_attention.py:57-59`` in 0.19.2:
    ``AssertionError: Context parallelism is only supported by TEDotProductAttention!``), and the
    project's ``ThdDotProductAttention`` (a subclass) inherits that refusal. So on CPU NeMo-RL's CP path
    cannot build a model at all.

WHAT
    :class:`CpThdDotProductAttention`, a drop-in core attention (same constructor) for
    ``spec.submodules.self_attention.submodules.core_attention`` of ``get_gpt_layer_local_spec()``.
    With ``cp == 1`` it is the project's ``ThdDotProductAttention``. With ``cp > 1`` and a packed THD
    batch it all-gathers K and V over the CP group (autograd-aware: the backward all-reduces the
    gathered gradient and keeps this rank's slice, a sum that gloo can do), gives every local query
    and every gathered key its (sequence, position-in-sequence) from the global ``cu_seqlens_padded``
    and the zigzag layout (rank ``r`` holds chunks ``r`` and ``2cp-1-r`` of each sequence), and runs the
    upstream ``DotProductAttention.forward`` with the block-diagonal causal mask between them: exact
    attention, O(t_local * t) memory, a test stand-in for TE's ring attention, not a fast path.
    RoPE, embeddings, the output layer and the loss are megatron-core's and NeMo-RL's own.

HOW
    A class chosen in the layer spec (as the project's ``ThdDotProductAttention``); no module of
    megatron-core is patched. The constructor passes the parent a shallow copy of the config with
    ``context_parallel_size=1`` (the assert is the only use the parent makes of it) and keeps the real
    config afterwards. CPU-only: it refuses to be built when ``torch.cuda.is_available()`` (use TE's
    attention on a GPU).
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

try:
    from megatron_pg_agg.megatron.thd_attention import ThdDotProductAttention
except ImportError:  # pragma: no cover
    raise

__all__ = ["CpThdDotProductAttention", "zigzag_positions"]


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward: all-reduce (sum) and keep this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        n = grad.size(0) // dist.get_world_size(ctx.group)
        r = dist.get_rank(ctx.group)
        return grad[r * n:(r + 1) * n], None


def zigzag_positions(cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int) -> tuple[Tensor, Tensor]:
    """(sequence index, position in that sequence) of each token CP rank ``cp_rank`` holds, for the
    global padded boundaries ``cu_seqlens_padded`` (each length a multiple of ``2 * cp_size``)."""
    seq_ids, positions = [], []
    cu = cu_seqlens_padded.tolist()
    for i in range(len(cu) - 1):
        length = cu[i + 1] - cu[i]
        if length % (2 * cp_size):
            raise ValueError(f"sequence {i} has padded length {length}, not a multiple of 2*cp={2 * cp_size}")
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            positions.append(torch.arange(c * chunk, (c + 1) * chunk))
            seq_ids.append(torch.full((chunk,), i))
    return torch.cat(seq_ids), torch.cat(positions)


class CpThdDotProductAttention(ThdDotProductAttention):
    """Local core attention that also runs packed THD batches under context parallelism (see module doc)."""

    def __init__(self, config, *args, **kwargs):
        if torch.cuda.is_available():
            raise RuntimeError("CpThdDotProductAttention is a CPU stand-in for TE's context-parallel attention; "
                               "use TE's attention on a GPU")
        local = copy.copy(config)
        local.context_parallel_size = 1
        super().__init__(local, *args, **kwargs)
        self.config = config
        pg = kwargs.get("pg_collection")
        self.cp_group = getattr(pg, "cp", None) if pg is not None else None
        if self.cp_group is None and config.context_parallel_size > 1:
            self.cp_group = parallel_state.get_context_parallel_group()

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> Tensor:
        cp = self.config.context_parallel_size
        if cp == 1:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise NotImplementedError("CpThdDotProductAttention: context parallelism needs packed THD batches "
                                      "(as NeMo-RL requires: sequence packing on with CP)")
        squeezed = query.dim() == 3
        if squeezed:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        rank = dist.get_rank(self.cp_group)
        seq_q, pos_q = zigzag_positions(cu.cpu(), cp, rank)
        keys = [zigzag_positions(cu.cpu(), cp, r) for r in range(cp)]
        seq_k = torch.cat([s for s, _ in keys])
        pos_k = torch.cat([p for _, p in keys])
        if seq_q.numel() != query.size(0):
            raise ValueError(f"{query.size(0)} local tokens but cu_seqlens_padded implies {seq_q.numel()}")
        masked = (seq_q[:, None] != seq_k[None, :]) | (pos_k[None, :] > pos_q[:, None])
        mask = masked.view(1, 1, *masked.shape).to(query.device)
        key_all = _GatherSeq.apply(key, self.cp_group)
        value_all = _GatherSeq.apply(value, self.cp_group)
        out = DotProductAttention.forward(self, query, key_all, value_all, mask, attn_mask_type, attention_bias)
        return out.squeeze(1) if squeezed else out
