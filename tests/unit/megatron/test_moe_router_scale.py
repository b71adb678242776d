"""The router's aux-loss gradient under the moe_aux_loss patch, on the installed release's real
TopKRouter: exactly ``d aux / d theta * W / M_total`` whatever the release multiplies in its
per-token branch (the routed-token count up to 0.18; count x TP x CP size from 0.19).

Catches: the patch no longer switching ``calculate_per_token_loss`` off around the call (the
gradient gains the token count, and on 0.19 the TP x CP size, given here a group of size 2),
or ``set_loss_scale`` dropping the step factor ``W / M_total``.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter

from megatron_pg_agg.megatron.layout import ParallelSizes
from megatron_pg_agg.megatron.model import build_model_chunks
from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel, teardown_parallel
from megatron_pg_agg.parity.models import tiny_transformer_config
from megatron_pg_agg.patches import apply_megatron_patches, moe_aux_loss, revert_megatron_patches
from megatron_pg_agg.versions import in_range, installed_megatron_core_version

TOKENS, W, M_TOTAL, D_AUX = 5, 6, 3, 3.0


class _GroupOfSize:
    """What 0.19's per-token branch reads of ``router.tp_cp_group``: its size (2 here, a TP x CP
    world this CPU machine cannot build with MoE: TP > 1 needs sequence parallelism)."""

    def size(self) -> int:
        return 2


@pytest.fixture(scope="module")
def router():
    newly_applied = apply_megatron_patches()
    owns_group = not dist.is_initialized()
    init_distributed()
    init_parallel(ParallelSizes())
    config = tiny_transformer_config(num_layers=1, num_moe_experts=4, moe_router_topk=2,
                                     moe_aux_loss_coeff=0.01, add_bias_linear=False,
                                     calculate_per_token_loss=True)
    chunks = build_model_chunks(config, 64, 32, share_embeddings_and_output_weights=False)
    found = next(m for c in chunks for m in c.modules() if isinstance(m, TopKRouter))
    found.train()
    if hasattr(found, "tp_cp_group"):
        found.tp_cp_group = _GroupOfSize()
    yield found
    teardown_parallel()
    if owns_group:
        dist.destroy_process_group()
    if newly_applied:
        revert_megatron_patches()


def _aux_gradient(router) -> float:
    theta = torch.tensor(1.0, requires_grad=True)
    activation = torch.zeros(TOKENS, 8, requires_grad=True)
    out = router.attach_and_log_load_balancing_loss(activation, 0.01, D_AUX * theta, "load_balancing_loss",
                                                    parallel_state.get_tensor_model_parallel_group())
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))  # what the schedule does after each forward
    out.sum().backward()
    return float(theta.grad)


def test_patched_aux_gradient_is_the_step_factor_times_the_loss_gradient(router):
    apply_megatron_patches(cpu_gloo=False, moe_aux_loss=True)
    try:
        moe_aux_loss.set_moe_aux_loss_scale(W, M_TOTAL)
        assert _aux_gradient(router) == pytest.approx(D_AUX * W / M_TOTAL, rel=1e-6)
    finally:
        moe_aux_loss.clear_moe_aux_loss_scale()
        revert_megatron_patches()
        apply_megatron_patches()


def test_control_unpatched_aux_gradient_carries_megatrons_per_token_multiply(router):
    """Without the patch the release's own multiply is there (so the test above can fail): the
    token count, times the TP x CP size from 0.19 (the notes: router.py at core_v0.19.0)."""
    tp_cp = 2 if in_range(installed_megatron_core_version(), ">=0.19") else 1
    assert _aux_gradient(router) == pytest.approx(D_AUX * TOKENS * tp_cp, rel=1e-6)
