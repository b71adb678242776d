"""ThdDotProductAttention: a packed THD batch must behave exactly like its sequences run alone.

Single process: a 1-rank gloo group and megatron parallel_state with TP=PP=1, the cpu_gloo patch
applied for the duration of the module.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType

from megatron_pg_agg.megatron.layout import ParallelSizes
from megatron_pg_agg.megatron.model import build_gpt, gpt_layer_spec
from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel, teardown_parallel
from megatron_pg_agg.megatron.thd_attention import ThdDotProductAttention, packed_attention_mask
from megatron_pg_agg.parity.models import tiny_transformer_config
from megatron_pg_agg.patches import apply_megatron_patches, revert_megatron_patches
from tests.support.thd_packing import next_token_targets, pack_sequences

VOCAB = 64
LENGTHS = (5, 11, 3)
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    newly_applied = apply_megatron_patches()
    owns_group = not dist.is_initialized()
    init_distributed()  # 1 rank, free port
    init_parallel(ParallelSizes())
    yield
    teardown_parallel()
    if owns_group:
        dist.destroy_process_group()
    if newly_applied:
        revert_megatron_patches()


def _sequences(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def _model(position="rope", **config_overrides):
    torch.manual_seed(1234)
    config = tiny_transformer_config(num_layers=2, **config_overrides)
    return build_gpt(config, VOCAB, max_seq_len=64, pre_process=True, post_process=True,
                          position_embedding_type=position)


def _separate_logits(model, seqs):
    return [model(s[None], torch.arange(s.numel())[None], None)[0] for s in seqs]


@pytest.mark.parametrize(
    "overrides,position",
    [({}, "rope"), ({"num_query_groups": 2}, "learned_absolute")],
    ids=["mha-rope", "gqa-learned"],
)
def test_packed_logits_and_grads_match_separate_runs(overrides, position):
    model = _model(position, **overrides)
    seqs = _sequences()
    batch = pack_sequences(seqs)
    weights = torch.randn(sum(LENGTHS), VOCAB, generator=torch.Generator().manual_seed(7))

    packed = model(batch.tokens, batch.position_ids, None,
                   packed_seq_params=batch.packed_seq_params)[0]
    (packed * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    alone = _separate_logits(model, seqs)
    (torch.cat(alone) * weights).sum().backward()

    assert packed.shape == (sum(LENGTHS), VOCAB)
    for off, ref in zip(batch.offsets, alone):
        torch.testing.assert_close(packed[off:off + ref.size(0)], ref, rtol=0, atol=TOL)
    for name, p in model.named_parameters():  # fp32 sums in another order: relative to the max
        err = (packed_grads[name] - p.grad).abs().max().item()
        assert err <= 1e-5 * max(p.grad.abs().max().item(), 1e-3), (name, err)


@pytest.mark.parametrize("pad_to_length", [None, 40])
def test_padded_pack_matches_on_real_tokens(pad_to_length):
    model = _model()
    seqs = _sequences()
    batch = pack_sequences(seqs, pad_to_multiple=4, pad_to_length=pad_to_length)
    padded = sum(-(-n // 4) * 4 for n in LENGTHS)
    assert batch.tokens.size(1) == (pad_to_length or padded)
    assert int(batch.packed_seq_params.cu_seqlens_q_padded[-1]) == batch.tokens.size(1)
    assert batch.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 16, 19]
    packed = model(batch.tokens, batch.position_ids, None,
                   packed_seq_params=batch.packed_seq_params)[0]
    for off, ref in zip(batch.offsets, _separate_logits(model, seqs)):
        torch.testing.assert_close(packed[off:off + ref.size(0)], ref, rtol=0, atol=TOL)


def test_next_token_targets_stay_inside_each_sequence():
    batch = pack_sequences([[1, 2, 3], [4, 5]], pad_to_multiple=4)
    labels, mask = next_token_targets(batch)
    assert batch.tokens.tolist() == [[1, 2, 3, 0, 4, 5, 0, 0]]
    assert labels.tolist() == [[2, 3, 0, 0, 5, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 0, 0, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="exceed"):
        pack_sequences([[1, 2, 3]], pad_to_length=2)


def test_control_unpacked_run_of_the_pack_differs():
    """Without packed_seq_params the sequences see each other: the parity check must notice."""
    model = _model()
    seqs = _sequences()
    batch = pack_sequences(seqs)
    mixed = model(batch.tokens, batch.position_ids, None)[0]
    alone = _separate_logits(model, seqs)
    later = slice(batch.offsets[1], batch.offsets[1] + LENGTHS[1])
    assert (mixed[later] - alone[1]).abs().max() > 1e-3


def test_spec_picks_local_thd_attention_on_cpu():
    assert not torch.cuda.is_available()
    for spec in (gpt_layer_spec(), gpt_layer_spec(use_te=False)):
        assert spec.submodules.self_attention.submodules.core_attention is ThdDotProductAttention
    with pytest.raises(RuntimeError, match="transformer_engine"):
        gpt_layer_spec(use_te=True)
    model = _model()
    attn = model.decoder.layers[0].self_attention.core_attention
    assert isinstance(attn, ThdDotProductAttention)


def test_packed_attention_mask_blocks_and_trailing_tokens():
    mask = packed_attention_mask(torch.tensor([0, 2, 5], dtype=torch.int32), 7)[0, 0]
    allowed = ~mask
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for lo, hi in ((0, 2), (2, 5), (5, 7)):  # positions 5, 6 form a trailing block
        for i in range(lo, hi):
            expected[i, lo:i + 1] = True
    assert torch.equal(allowed, expected)
    non_causal = ~packed_attention_mask(torch.tensor([0, 2, 5]), 5, causal=False)[0, 0]
    assert non_causal[0, 1] and not non_causal[1, 2] and non_causal[2, 4]


class _FakeTP:
    """A TP group of size 2 as seen by the attention constructor (it only asks for the size)."""

    def size(self):
        return 2

    def rank(self):
        return 0


@pytest.mark.parametrize("groups", [4, 2])
def test_tensor_parallel_head_partition(groups):
    """With TP=2 the module holds heads/2 (and groups/2 for GQA) heads and returns hidden/2."""
    config = tiny_transformer_config(num_layers=1, num_query_groups=groups)
    attn = ThdDotProductAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        pg_collection=SimpleNamespace(tp=_FakeTP()),
    )
    heads, d = config.num_attention_heads // 2, config.kv_channels
    assert attn.num_attention_heads_per_partition == heads
    assert attn.num_query_groups_per_partition == groups // 2
    g = torch.Generator().manual_seed(3)
    t = sum(LENGTHS)
    q = torch.randn(t, heads, d, generator=g)  # THD layout as Attention hands it over
    k = torch.randn(t, groups // 2, d, generator=g)
    v = torch.randn(t, groups // 2, d, generator=g)
    batch = pack_sequences(_sequences())
    out = attn(q, k, v, None, packed_seq_params=batch.packed_seq_params)
    assert out.shape == (t, config.hidden_size // 2)
    for off, n in zip(batch.offsets, LENGTHS):
        sl = slice(off, off + n)
        alone = attn(q[sl, None], k[sl, None], v[sl, None], None)
        assert alone.shape == (n, 1, config.hidden_size // 2)
        torch.testing.assert_close(out[sl], alone[:, 0], rtol=0, atol=TOL)


def test_a_config_with_the_fused_softmax_still_keeps_packed_sequences_apart():
    """masked_softmax_fusion on (megatron-core's CUDA default) with bf16 and a pack of 32 tokens (a
    shape its fused kernel takes): the packed output is each sequence's alone, as without the
    fusion. Catches the fused causal kernel being used: it ignores the block mask (sequences see
    each other), and without apex its import fails (ModuleNotFoundError, as here on CPU)."""
    lengths = (9, 15, 8)
    outputs = []
    for fusion in (True, False):
        config = tiny_transformer_config(num_layers=1, bf16=True, params_dtype=torch.bfloat16,
                                         masked_softmax_fusion=fusion)
        attn = ThdDotProductAttention(config, 1, AttnMaskType.causal, "self")
        g = torch.Generator().manual_seed(5)
        heads, d, t = config.num_attention_heads, config.kv_channels, sum(lengths)
        q, k, v = (torch.randn(t, heads, d, generator=g).bfloat16() for _ in range(3))
        batch = pack_sequences(_sequences(lengths))
        out = attn(q, k, v, None, packed_seq_params=batch.packed_seq_params)
        alone = [attn(q[o:o + n, None], k[o:o + n, None], v[o:o + n, None], None)[:, 0]
                 for o, n in zip(batch.offsets, lengths)]
        torch.testing.assert_close(out, torch.cat(alone), rtol=0, atol=0)
        outputs.append(out)
    assert (t * heads) % 4 == 0 and t % 4 == 0  # a shape the fused kernel would take
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


def test_rejects_non_thd_and_batched_packs():
    config = tiny_transformer_config(num_layers=1)
    attn = ThdDotProductAttention(config, 1, AttnMaskType.causal, "self")
    q = torch.randn(6, 2, 4, config.kv_channels)
    params = pack_sequences([[1, 2, 3], [4, 5, 6]]).packed_seq_params
    with pytest.raises(ValueError, match="micro-batch size 1"):
        attn(q, q, q, None, packed_seq_params=params)
    sbhd = type(params)(qkv_format="sbhd", cu_seqlens_q=params.cu_seqlens_q)
    with pytest.raises(NotImplementedError, match="thd"):
        attn(q, q, q, None, packed_seq_params=sbhd)
    assert parallel_state.model_parallel_is_initialized()


MANY = (2, 7, 3, 5, 1, 6, 4, 2, 7, 3, 5, 6)
"""Short sequences, many of them: the pack takes the padded-batch form (13 x 7^2 < 51^2 scores)."""


def test_a_pack_of_many_short_sequences_takes_the_padded_form_and_matches_separate_runs():
    """The padded-batch form (ThdDotProductAttention._padded_forward) against each sequence run alone
    through upstream's own causal path: logits and gradients. Catches a token read back from another
    block or offset, a key past a block's end left visible, or causality lost inside a block."""
    model = _model()
    seqs = _sequences(MANY, seed=3)
    batch = pack_sequences(seqs)
    attn = model.decoder.layers[0].self_attention.core_attention
    params, total = batch.packed_seq_params, sum(MANY)
    assert attn._padded_is_cheaper(params, params.cu_seqlens_q_padded, total, None, None)
    weights = torch.randn(total, VOCAB, generator=torch.Generator().manual_seed(7))
    packed = model(batch.tokens, batch.position_ids, None, packed_seq_params=params)[0]
    (packed * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    alone = _separate_logits(model, seqs)
    (torch.cat(alone) * weights).sum().backward()
    for off, ref in zip(batch.offsets, alone):
        torch.testing.assert_close(packed[off:off + ref.size(0)], ref, rtol=0, atol=TOL)
    for name, p in model.named_parameters():
        err = (packed_grads[name] - p.grad).abs().max().item()
        assert err <= 1e-5 * max(p.grad.abs().max().item(), 1e-3), (name, err)


@pytest.mark.parametrize("cu, total", [([0, 2, 2, 5, 9], 9), ([0, 3, 6], 8), ([0, 4, 9, 9, 9], 9)],
                         ids=["empty-block", "trailing-tokens", "ghost-blocks"])
def test_the_padded_form_equals_the_mask_form(cu, total):
    """One core attention, the same q/k/v, both forms (the padded one forced by max_seqlen): equal to 1e-6,
    with an empty block, tokens after the last boundary, and Megatron-LM's repeated last boundary."""
    config = tiny_transformer_config(num_layers=1)
    attn = ThdDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                  attention_type="self")
    heads, dim = config.num_attention_heads, config.kv_channels
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, heads, dim, generator=g) for _ in range(3))
    cu = torch.tensor(cu, dtype=torch.int32)
    mask_form = ThdDotProductAttention.forward(
        attn, q, k, v, None, packed_seq_params=SimpleNamespace(
            qkv_format="thd", cu_seqlens_q_padded=cu, cu_seqlens_q=cu, max_seqlen_q=None))
    padded_form = attn._padded_forward(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), cu, 5, True, None)
    torch.testing.assert_close(padded_form, mask_form, rtol=0, atol=1e-6)
