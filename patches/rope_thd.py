"""Unfused RoPE on packed (THD) sequences in one shot instead of one autograd chain per sequence.

WHY
    megatron-core 0.19 rewrote the unfused THD RoPE (``rope_utils._apply_rotary_pos_emb_thd``):
    when ``freqs`` holds the positions of the longest sequence (``[max_s, 1, 1, d]``, what
    ``GPTModel`` passes for packed sequences), it applies RoPE one packed sequence at a time:
    a split, a frequency slice (a ``cat`` of two under CP), cos, sin, two casts, a chunk, a
    negation, a ``cat``, two products, a sum, a ``cat`` and a copy into the output, about 15
    small autograd ops per sequence, forward and backward, plus a ``.tolist()`` and an
    ``.item()`` host sync per call. Every packed micro-batch of this project takes that path
    whenever RoPE fusion is off: always on CPU, and on a GPU without Transformer Engine
    (``TransformerConfig`` refuses ``apply_rope_fusion`` without it, so ``apply_rotary_pos_emb``
    falls through to the unfused branch, and ``Attention.forward`` passes ``cu_seqlens`` for
    every ``thd`` batch). megatron-core 0.15 to 0.18 built the packed frequencies once and
    applied RoPE once.

WHAT (the contract, the same values as upstream's)
    Row ``r`` of ``t`` (``[T, h, d]``, the local rows of this CP rank) belongs to packed sequence
    ``i`` with local length ``n_i = (cu_seqlens[i+1] - cu_seqlens[i]) // C`` and sits at
    ``j = r - sum_{k<i} n_k`` within it. Its position is ``p = j`` when ``C = 1``; under CP
    (``C`` ranks, rank ``c``, Megatron's load-balanced split of each sequence into ``2C`` chunks
    of ``s_i = n_i // 2`` rows, this rank holding chunks ``c`` and ``2C - 1 - c``)
    ``p = c * s_i + j`` for ``j < s_i`` and ``p = C * n_i - (c + 1) * s_i + (j - s_i)`` after.
    The output row is megatron-core's own ``_apply_rotary_pos_emb_bshd`` of that row with
    ``freqs[p]``: the per-position frequencies are gathered once (``index_select``) and RoPE is
    applied once to the whole packed tensor, as 0.16 did. RoPE is elementwise per row, so this
    is upstream's arithmetic on the same operands; gradients flow to ``t`` (and ``freqs``).
    Megatron's THD contract is assumed, as upstream assumes it: ``cu_seqlens[0] = 0`` and every
    sequence length a multiple of ``2C`` under CP, so ``cu_seqlens[-1] = C * T``.

    Covered (computed here): ``multi_latent_attention`` (the deprecated alias) not given, a
    ``cp_group``, ``t`` of 3 dims, ``freqs`` of shape ``[max_s, 1, 1, d]`` with
    ``max_s != C * T`` (upstream's "no packed freqs" case). Every other call (packed
    per-token ``freqs``, other shapes, no group) goes to upstream's function unchanged.

HOW (a wrapper only, never a copy of the upstream function)
    ``rope_utils._apply_rotary_pos_emb_thd`` (what ``apply_rotary_pos_emb`` calls by its module
    name) binds its arguments by name against the original's signature; covered calls build the
    row positions on the tensors' device without a host sync (``repeat_interleave`` with
    ``output_size``, no ``.item()``/``.tolist()``) and call the release's
    ``_apply_rotary_pos_emb_bshd`` once.

TARGETS (megatron-core >=0.19,<0.20)
    ``megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_thd``. Any device.
    ``rotary_pos_embedding`` re-exports the name for backward compatibility only; nothing calls
    it from there.
"""
from __future__ import annotations

import importlib
import inspect

import torch

from ..versions import in_range, installed_megatron_core_version
from ._machinery import Patch, Target

NAME = "rope_thd"
SUPPORTED = ">=0.19.0,<0.20"
UNSUPPORTED_REASON = ("megatron-core 0.15 to 0.18 build the packed RoPE frequencies once and apply RoPE once "
                      "(no per-sequence loop to replace)")

_ROPE = "megatron.core.models.common.embeddings.rope_utils"


def needed() -> bool:
    """Whether the installed megatron-core has the per-sequence loop (what every entry asks before
    applying the patch)."""
    return in_range(installed_megatron_core_version(), SUPPORTED)


def packed_positions(cu_seqlens: torch.Tensor, rows: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The RoPE position of each of the ``rows`` local rows (int64, on ``cu_seqlens``' device): the
    module docstring's ``p``. No host sync."""
    cu = cu_seqlens.to(torch.long)
    lengths = (cu[1:] - cu[:-1]) // cp_size
    starts = torch.cumsum(lengths, 0) - lengths
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths, output_size=rows)
    within = torch.arange(rows, device=cu.device) - starts[seq]
    if cp_size == 1:
        return within
    half = lengths[seq] // 2
    front = cp_rank * half + within
    back = cp_size * lengths[seq] - (cp_rank + 1) * half + (within - half)
    return torch.where(within < half, front, back)


def _covered(args: dict) -> bool:
    """Whether a bound call is the case this patch computes (the module docstring's "Covered")."""
    t, freqs, group = args["t"], args["freqs"], args["cp_group"]
    if args.get("multi_latent_attention") is not None or group is None:
        return False
    if t.dim() != 3 or freqs.dim() != 4 or freqs.size(1) != 1 or freqs.size(2) != 1:
        return False
    return freqs.size(0) != group.size() * t.size(0)


def _make_thd(original):
    signature = inspect.signature(original)
    rope = importlib.import_module(_ROPE)

    def _apply_rotary_pos_emb_thd(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if not _covered(a):
            return original(*args, **kwargs)
        t, group = a["t"], a["cp_group"]
        positions = packed_positions(a["cu_seqlens"], t.size(0), group.size(), group.rank())
        freqs = a["freqs"].index_select(0, positions.to(a["freqs"].device))
        return rope._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs, rotary_interleaved=a["rotary_interleaved"],
                                               mla_rotary_interleaved=a["mla_rotary_interleaved"],
                                               mscale=a["mscale"]).squeeze(1)

    return _apply_rotary_pos_emb_thd


PATCH = Patch(
    name=NAME,
    supported=SUPPORTED,
    why=__doc__,
    unsupported_reason=UNSUPPORTED_REASON,
    targets=(Target(_ROPE, "_apply_rotary_pos_emb_thd", _make_thd),),
)
