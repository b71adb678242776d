"""The ``rope_thd`` patch (megatron-core 0.19): unfused THD RoPE in one shot, equal to upstream's per-sequence
loop (outputs and gradients, to 1e-6) on ragged packed batches, at CP 1 and CP 2, and every case it does not cover
handed to upstream's function.

The CP group: upstream's function and the patch read only ``cp_group.size()`` and ``cp_group.rank()`` (neither
communicates), so both ranks of a CP-2 group are checked in this one process with :class:`CpGroup` standing in for
the group, with no launch. (No run of this project takes the unfused path with CP > 1: the trainer refuses
``--context-parallel-size > 1`` without Transformer Engine, and with it RoPE fusion uses TE's kernel.)
"""
from __future__ import annotations

import pytest
import torch

from megatron_pg_agg.patches import _machinery, rope_thd
from megatron_pg_agg.versions import in_range, installed_megatron_core_version

INSTALLED = installed_megatron_core_version()
IN_RANGE = in_range(INSTALLED, rope_thd.SUPPORTED)
needs_release = pytest.mark.skipif(
    not IN_RANGE, reason=f"the rope_thd patch supports megatron-core {rope_thd.SUPPORTED} (installed {INSTALLED}): "
                         "older releases apply RoPE once, with no per-sequence loop to replace")

HEADS, DIM, MAX_S = 3, 8, 64
RAGGED_CP1 = {
    "one_token_each": [0, 1, 2, 3, 4],
    "ragged": [0, 5, 6, 13, 16, 40],
    "empty_between": [0, 7, 7, 8, 20],
    "single": [0, 11],
}
"""``cu_seqlens`` of CP 1: length-1 sequences, ragged lengths, a zero-length (padding) entry, one sequence."""
RAGGED_CP2 = {
    "short": [0, 4, 8, 12],
    "ragged_padded": [0, 4, 16, 20, 44, 48],
    "empty_between": [0, 8, 8, 12, 28],
}
"""``cu_seqlens`` of CP 2 (padded: every length a multiple of ``2 * CP``, Megatron's THD contract under CP)."""


class CpGroup:
    """What ``_apply_rotary_pos_emb_thd`` reads of a process group: its size and this process's rank."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def upstream_and_patched():
    """(upstream's function, the patched one); the patch is reverted afterwards."""
    from megatron.core.models.common.embeddings import rope_utils

    _machinery.revert(rope_thd.NAME)
    upstream = rope_utils._apply_rotary_pos_emb_thd
    assert _machinery.apply(rope_thd.PATCH)
    try:
        yield upstream, rope_utils._apply_rotary_pos_emb_thd
    finally:
        _machinery.revert(rope_thd.NAME)


def _inputs(cu: list, cp: int, dtype=torch.float32, seed=0, freqs_dim=DIM):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(cu[-1] // cp, HEADS, DIM, generator=gen, dtype=dtype)
    freqs = torch.rand(MAX_S, 1, 1, freqs_dim, generator=gen, dtype=dtype) * 6
    weight = torch.randn(t.shape, generator=gen, dtype=dtype)
    return t, torch.tensor(cu, dtype=torch.int32), freqs, weight


def _run(fn, t, cu, freqs, weight, **kw):
    """Output, d(sum(out * weight))/dt and /dfreqs."""
    t, freqs = t.clone().requires_grad_(), freqs.clone().requires_grad_()
    out = fn(t, cu, freqs, **kw)
    (out * weight).sum().backward()
    return out.detach(), t.grad, freqs.grad


def _assert_same(a, b):
    for x, y, what in zip(a, b, ("output", "grad t", "grad freqs")):
        assert x.shape == y.shape, what
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=what)


def _cases():
    for name, cu in RAGGED_CP1.items():
        yield pytest.param(cu, 1, 0, id=f"cp1-{name}")
    for name, cu in RAGGED_CP2.items():
        for rank in (0, 1):
            yield pytest.param(cu, 2, rank, id=f"cp2-rank{rank}-{name}")


@needs_release
@pytest.mark.parametrize("cu, cp, rank", list(_cases()))
@pytest.mark.parametrize("variant", [{}, {"rotary_interleaved": True}, {"mla_rotary_interleaved": True},
                                     {"mscale": 0.7}], ids=["plain", "interleaved", "mla", "mscale"])
def test_outputs_and_grads_equal_upstream(upstream_and_patched, cu, cp, rank, variant):
    upstream, patched = upstream_and_patched
    t, cu_t, freqs, weight = _inputs(cu, cp)
    kw = dict(cp_group=CpGroup(cp, rank), **variant)
    # upstream's interleaved _rotate_half cannot view a zero-length sequence (it raises): it gets the same batch
    # without its empty entries (the same rows, the same sequences)
    cu_upstream = torch.tensor(sorted(set(cu)), dtype=torch.int32) if variant.get("rotary_interleaved") else cu_t
    _assert_same(_run(patched, t, cu_t, freqs, weight, **kw), _run(upstream, t, cu_upstream, freqs, weight, **kw))


@needs_release
def test_partial_rotary_dim_and_float64_equal_upstream(upstream_and_patched):
    """``freqs`` narrower than ``t`` (the rest passes through) and float64 inputs."""
    upstream, patched = upstream_and_patched
    args = _inputs(RAGGED_CP2["ragged_padded"], 2, dtype=torch.float64, freqs_dim=DIM // 2)
    kw = dict(cp_group=CpGroup(2, 1))
    _assert_same(_run(patched, *args, **kw), _run(upstream, *args, **kw))


def _reference_positions(cu: list, cp: int, rank: int) -> list:
    """Each local row's position, from Megatron's CP layout: sequence ``i`` (length ``L``) is cut into ``2 cp``
    chunks of ``L / (2 cp)``; rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, in that order."""
    positions = []
    for start, end in zip(cu[:-1], cu[1:]):
        chunk = (end - start) // (2 * cp) if cp > 1 else end - start
        for piece in ((rank, 2 * cp - 1 - rank) if cp > 1 else (0,)):
            positions += range(piece * chunk, (piece + 1) * chunk)
    return positions


def _reference_rope(t, freqs, positions):
    """float64 RoPE from its definition: ``x * cos(f_p) + rotate_half(x) * sin(f_p)``, rotate_half(x) = [-x2, x1]."""
    out = torch.empty_like(t, dtype=torch.float64)
    for row, p in enumerate(positions):
        f = freqs[p, 0, 0].double()
        x = t[row].double()
        x1, x2 = x[:, : DIM // 2], x[:, DIM // 2:]
        out[row] = x * f.cos() + torch.cat([-x2, x1], dim=-1) * f.sin()
    return out


@needs_release
@pytest.mark.parametrize("cu, cp, rank", list(_cases()))
def test_output_equals_the_definition(upstream_and_patched, cu, cp, rank):
    """Independent of upstream: the rows' positions restart at 0 in every sequence and follow the CP layout."""
    _, patched = upstream_and_patched
    t, cu_t, freqs, _ = _inputs(cu, cp)
    positions = _reference_positions(cu, cp, rank)
    assert rope_thd.packed_positions(cu_t, t.size(0), cp, rank).tolist() == positions
    out = patched(t, cu_t, freqs, cp_group=CpGroup(cp, rank))
    torch.testing.assert_close(out.double(), _reference_rope(t, freqs, positions), rtol=0, atol=1e-5)


@needs_release
def test_reached_through_apply_rotary_pos_emb_with_fusion_off(upstream_and_patched):
    """megatron-core's dispatcher (what Attention.forward calls) takes the patched path when RoPE fusion is off."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               apply_rope_fusion=False)
    seen = []
    bshd = rope_utils._apply_rotary_pos_emb_bshd
    t, cu, freqs, _ = _inputs(RAGGED_CP1["ragged"], 1)
    try:
        rope_utils._apply_rotary_pos_emb_bshd = lambda x, f, **kw: seen.append(x.shape[0]) or bshd(x, f, **kw)
        rope_utils.apply_rotary_pos_emb(t, freqs, config=config, cu_seqlens=cu, cp_group=CpGroup(1, 0))
    finally:
        rope_utils._apply_rotary_pos_emb_bshd = bshd
    assert seen == [t.size(0)], "one RoPE application over the whole packed tensor"


@needs_release
def test_other_cases_go_to_upstream(upstream_and_patched):
    upstream, patched = upstream_and_patched
    cu_list = RAGGED_CP2["ragged_padded"]
    t, cu, _, weight = _inputs(cu_list, 2)
    # freqs with one row per packed token (positions continue across sequences): upstream's offset mapping
    packed = torch.rand(cu_list[-1], 1, 1, DIM, generator=torch.Generator().manual_seed(1))
    kw = dict(cp_group=CpGroup(2, 1))
    _assert_same(_run(patched, t, cu, packed, weight, **kw), _run(upstream, t, cu, packed, weight, **kw))
    # (not what the covered case computes: positions restarting at 0 in every sequence)
    from megatron.core.models.common.embeddings import rope_utils

    restarting = packed.index_select(0, rope_thd.packed_positions(cu, t.size(0), 2, 1))
    covered_form = rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), restarting).squeeze(1)
    assert not torch.allclose(patched(t, cu, packed, **kw), covered_form)
    with pytest.raises(ValueError, match="cp_group must be provided"):
        patched(t, cu, packed)
    with pytest.warns(DeprecationWarning, match="multi_latent_attention is deprecated"):
        patched(*_inputs(RAGGED_CP1["ragged"], 1)[:3], cp_group=CpGroup(1, 0), multi_latent_attention=False)


@needs_release
def test_applied_and_reverted_with_marker_and_wrapped():
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_pg_agg.patches import PATCHES, apply_megatron_patches

    assert PATCHES[rope_thd.NAME] is rope_thd.PATCH and rope_thd.needed()
    original = rope_utils._apply_rotary_pos_emb_thd
    try:
        assert apply_megatron_patches(cpu_gloo=False, rope_thd=True) == [rope_thd.NAME]
        assert rope_utils._apply_rotary_pos_emb_thd.__wrapped__ is original
        assert getattr(rope_utils._apply_rotary_pos_emb_thd, _machinery.MARKER) == rope_thd.NAME
    finally:
        _machinery.revert(rope_thd.NAME)
    assert rope_utils._apply_rotary_pos_emb_thd is original


@pytest.mark.skipif(IN_RANGE, reason=f"megatron-core {INSTALLED} is in the patch's range")
def test_refused_outside_its_releases():
    """0.15 to 0.18 apply RoPE once already: the patch refuses there and the entries do not ask for it."""
    assert not rope_thd.needed()
    with pytest.raises(RuntimeError, match="no per-sequence loop"):
        _machinery.apply(rope_thd.PATCH)
    assert not _machinery.is_applied(rope_thd.NAME)
