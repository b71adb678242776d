"""Megatron-LM #7452 finding 10 on this project's path: ``get_tokens_per_expert_and_token_count``
with a ``padding_mask`` under TP/SP or CP all-reduces the local token count in place, so the MoE
aux-loss gradient gains the tp x cp size. The finding needs a padding mask to reach the router;
here the installed release's real MoE layer runs on a planned packed THD microbatch through
``forward_microbatch`` (what the trainer, Megatron-LM's entries and verl's engine plug-in call),
and ``MoELayer.route`` is watched: it gets no mask (the packing's padding lives in
``cu_seqlens_padded``, never in a mask). Catches a ``padding_mask`` added to the model call."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.megatron.layout import ParallelSizes
from megatron_pg_agg.megatron.loss_func import forward_microbatch
from megatron_pg_agg.megatron.model import build_model_chunks
from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel, teardown_parallel
from megatron_pg_agg.parity.models import tiny_transformer_config
from megatron_pg_agg.patches import apply_megatron_patches, revert_megatron_patches
from tests.support.rollouts import VOCAB, fixed_step


@pytest.fixture(scope="module")
def moe_model():
    newly_applied = apply_megatron_patches(cpu_gloo=True)
    owns_group = not dist.is_initialized()
    init_distributed()
    init_parallel(ParallelSizes())
    config = tiny_transformer_config(num_layers=2, num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                                     add_bias_linear=False, calculate_per_token_loss=True)
    chunks = build_model_chunks(config, VOCAB, 128, share_embeddings_and_output_weights=True)
    yield chunks[0]
    teardown_parallel()
    if owns_group:
        dist.destroy_process_group()
    if newly_applied:
        revert_megatron_patches()


@pytest.mark.skipif(not hasattr(MoELayer, "route"),
                    reason="megatron-core 0.15's MoE layer takes no padding mask (the finding cannot occur)")
def test_the_moe_router_gets_no_padding_mask_from_a_packed_microbatch(moe_model, monkeypatch):
    masks = []
    route = MoELayer.route

    def watched_route(self, hidden_states, padding_mask=None):
        masks.append(padding_mask)
        return route(self, hidden_states, padding_mask)

    monkeypatch.setattr(MoELayer, "route", watched_route)
    plan = plan_step(fixed_step(), PGLossConfig(mode="token_mean"),
                     PlanConfig(dp_size=1, num_microbatches=2, tp_size=4, sequence_parallel=True))
    mb = plan.for_rank(0)[0]
    assert not torch.equal(mb.cu_seqlens, mb.cu_seqlens_padded)  # a packing with padding tokens
    moe_model.eval()
    with torch.no_grad():
        logits = forward_microbatch(moe_model, mb)
    assert logits.shape[1] == mb.tokens.shape[-1]
    assert len(masks) == 2 and all(m is None for m in masks), masks  # both layers routed, without a mask
