"""Megatron-core GPT models for the trainer, the workers and the parity checks.

WHY
    The aggregation is only proven exact if the real megatron-core pieces run: GPTModel,
    tensor-parallel layers, the pipeline schedules, DDP and ``finalize_model_grads``. These
    helpers build them one way everywhere (tests, ``tests/distributed`` workers, benchmarks):

    * :func:`transformer_config`: a ``TransformerConfig`` with ``calculate_per_token_loss=True``
      whose fusions follow the device (:func:`device_settings`: off on CPU, Megatron-LM's
      defaults on CUDA).
    * :func:`gpt_layer_spec`: TE's layer spec on a CUDA machine with Transformer Engine,
      otherwise the local spec with :class:`~megatron_pg_agg.megatron.thd_attention.ThdDotProductAttention`
      as core attention (packed THD batches need it: the local attention rejects them).
    * :func:`build_gpt` / :func:`build_model_chunks` / :func:`wrap_in_ddp`.

    On CPU apply the ``cpu_gloo`` patch first (``megatron_pg_agg.patches``).
"""
from __future__ import annotations

import importlib.util
import inspect
from dataclasses import fields
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from .mtp import mtp_block_spec, return_main_logits
from .thd_attention import ThdDotProductAttention

__all__ = [
    "attach_sync_funcs",
    "build_model_chunks",
    "build_gpt",
    "build_stage_chunks",
    "default_ddp_config",
    "gpt_layer_spec",
    "device_settings",
    "gather_parameters",
    "hf_contract_settings",
    "te_usable",
    "transformer_config",
    "full_param_layouts",
    "wrap_in_ddp",
]

# What every model built here needs, on any device.
_CONTRACT = dict(
    # the exact aggregation needs the 3-tuple loss contract
    calculate_per_token_loss=True,
    # RL ratios compare the trainer's log-probs with the rollout's: the same network both times
    hidden_dropout=0.0,
    attention_dropout=0.0,
    # Packed micro-batches of different lengths need variable_seq_lengths=True (p2p exchanges
    # shapes first); callers turn it on under PP. The dispatcher setting is unused by a dense
    # model, but TransformerConfig rejects the default "allgather" together with
    # variable_seq_lengths=True even without experts.
    variable_seq_lengths=False,
    moe_token_dispatcher_type="alltoall",
)


def _no_cuda_graph_modules() -> dict:
    """No CUDA-graph modules, under the field name of the installed release: ``cuda_graph_scope``
    up to 0.17, ``cuda_graph_modules`` from 0.18 (which deprecates the old name and warns on it).
    The same as megatron-core's default "full" (no CUDA graphs are captured either way), without
    the deprecation warning that default itself raises in 0.16."""
    names = {f.name for f in fields(TransformerConfig)}
    return {"cuda_graph_modules" if "cuda_graph_modules" in names else "cuda_graph_scope": []}

JIT_FUSIONS = ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion")
"""Fusions megatron-core compiles itself (torch JIT / its own kernels): CUDA only."""
TE_FUSIONS = ("apply_rope_fusion", "gradient_accumulation_fusion", "persist_layer_norm")
"""Fusions that call Transformer Engine's (or apex's) kernels."""

# CPU (gloo): fp32, weights built on the CPU, every fused kernel off, and no batched p2p (gloo
# mismatches batched isend/irecv with interleaved pipelines, and the sync after it is a
# torch.cuda.synchronize; see patches/cpu/cpu_gloo.py).
_CPU = dict(
    params_dtype=torch.float32,
    pipeline_dtype=torch.float32,
    use_cpu_initialization=True,
    batch_p2p_comm=False,
    batch_p2p_sync=False,
    **{name: False for name in JIT_FUSIONS + TE_FUSIONS},
)


def device_settings(cuda: Optional[bool] = None, te: Optional[bool] = None) -> dict:
    """``TransformerConfig`` fields that follow the device. CPU: :data:`_CPU` (fused kernels off).
    CUDA: Megatron-LM's training defaults: :data:`JIT_FUSIONS` on, and :data:`TE_FUSIONS` on
    when Transformer Engine is usable."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        return dict(_CPU)
    te = te_usable() if te is None else te
    return {**{name: True for name in JIT_FUSIONS}, **{name: te for name in TE_FUSIONS}}


def transformer_config(**overrides) -> TransformerConfig:
    """A ``TransformerConfig`` with the loss contract (:data:`_CONTRACT`) and the settings of the
    device it runs on (:func:`device_settings`); ``overrides`` win.

    Pass the sizes and the parallel sizes here (``tensor_model_parallel_size``,
    ``pipeline_model_parallel_size``, ``virtual_pipeline_model_parallel_size``,
    ``context_parallel_size``); they must match ``parallel_state``. The tiny models of the parity
    harness and the tests are ``megatron_pg_agg.parity.models.tiny_transformer_config``.
    """
    return TransformerConfig(**{**_CONTRACT, **_no_cuda_graph_modules(), **device_settings(), **overrides})


MOE_TE_FUSIONS = ("moe_permute_fusion", "moe_grouped_gemm", "moe_router_fusion")
"""MoE kernels that need Transformer Engine (a model provider may turn them on)."""


def hf_contract_settings(cuda: Optional[bool] = None) -> dict:
    """What :func:`transformer_config` puts on every model, as fields to set on a Megatron-Bridge
    provider whose shape comes from an HF config: the loss contract, no CUDA graphs and the
    device's settings; on CPU also the TE-only MoE kernels off."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    cpu_only = {} if cuda else {name: False for name in MOE_TE_FUSIONS}
    return {**_CONTRACT, **_no_cuda_graph_modules(), **device_settings(cuda), **cpu_only}


def te_usable() -> bool:
    """Transformer Engine importable and CUDA available (TE's attention needs a GPU)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def gpt_layer_spec(use_te: Optional[bool] = None, num_experts: Optional[int] = None) -> ModuleSpec:
    """The GPT layer spec: TE's when ``use_te`` is not False and TE is usable, else the local spec
    with ``ThdDotProductAttention`` at ``submodules.self_attention.submodules.core_attention``.
    ``num_experts`` (MoE): megatron-core's MoE layer (router, experts, token dispatcher) as the
    MLP of every layer, as ``get_gpt_layer_*_spec(num_experts=...)`` builds it.

    ``use_te=True`` without a usable TE raises instead of silently falling back.
    """
    if use_te is None:
        use_te = te_usable()
    if use_te:
        if not te_usable():
            raise RuntimeError("use_te=True needs transformer_engine and a CUDA device")
        # Transformer Engine is an optional GPU extra: its spec is imported only when asked for
        from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: PLC0415
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts)
    spec = get_gpt_layer_local_spec(num_experts=num_experts)
    spec.submodules.self_attention.submodules.core_attention = ThdDotProductAttention
    return spec


def build_gpt(
    config: TransformerConfig,
    vocab_size: int,
    max_seq_len: int,
    pre_process: bool,
    post_process: bool,
    vp_stage: Optional[int] = None,
    *,
    spec: Optional[ModuleSpec] = None,
    position_embedding_type: str = "rope",
    share_embeddings_and_output_weights: bool = True,
) -> GPTModel:
    """A megatron-core ``GPTModel`` for one (virtual) pipeline stage; ``spec`` defaults to
    :func:`gpt_layer_spec` (MoE layers when ``config.num_moe_experts`` is set). Tied embeddings
    with PP > 1 need the ``cpu_gloo`` patch on CPU. With ``config.mtp_num_layers`` the last stage
    holds megatron-core's MTP block for the same layer spec, and the model returns its main
    head's logits when given labels (:mod:`.mtp`)."""
    layer_spec = spec if spec is not None else gpt_layer_spec(num_experts=config.num_moe_experts)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        mtp_block_spec=mtp_block_spec(config, layer_spec, use_te=te_usable(), vp_stage=vp_stage),
        vocab_size=vocab_size,
        max_sequence_length=max_seq_len,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type,
        vp_stage=vp_stage,
    )
    if config.mtp_num_layers:
        return_main_logits(model)
    return model


def build_model_chunks(
    config: TransformerConfig, vocab_size: int, max_seq_len: int, **kwargs
) -> list[GPTModel]:
    """This rank's model chunks for the current ``parallel_state``: one per virtual stage
    (one in all without interleaving), with ``pre_process``/``post_process`` from the stage."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp != config.virtual_pipeline_model_parallel_size:
        raise ValueError(
            f"config.virtual_pipeline_model_parallel_size="
            f"{config.virtual_pipeline_model_parallel_size} but parallel_state has {vpp}"
        )
    return build_stage_chunks(lambda **stage: build_gpt(config, vocab_size, max_seq_len, **stage, **kwargs))


def build_stage_chunks(build) -> list:
    """``[build(pre_process=..., post_process=..., vp_stage=...)]`` for each of this rank's
    (virtual) pipeline stages in the current ``parallel_state``: one per virtual stage, or one
    (``vp_stage=None``) without interleaving. Models built from flags and from an HF config
    (a Megatron-Bridge provider's ``provide``) are cut the same way."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    stages = [None] if vpp is None else list(range(vpp))
    return [build(pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=s),
                  post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=s),
                  vp_stage=s) for s in stages]


def default_ddp_config(**overrides) -> DistributedDataParallelConfig:
    """DDP settings the per-token-loss contract needs (``average_in_collective=False``: with
    ``calculate_per_token_loss`` DDP sums over DP x CP and ``finalize_model_grads`` divides by the
    global token count; gloo has no ``ReduceOp.AVG`` anyway)."""
    kwargs = dict(
        use_distributed_optimizer=False,
        average_in_collective=False,
        overlap_grad_reduce=False,
        grad_reduce_in_fp32=False,
    )
    return DistributedDataParallelConfig(**{**kwargs, **overrides})


def wrap_in_ddp(
    chunks: list[torch.nn.Module],
    config: TransformerConfig,
    ddp_config: Optional[DistributedDataParallelConfig] = None,
) -> list[DistributedDataParallel]:
    """Wrap each chunk in megatron-core DDP (bucketing only for the first chunk, as Megatron-LM),
    with the distributed optimizer's parameter layout where the release takes one
    (:func:`full_param_layouts`), and give the schedules the chunks' sync functions
    (:func:`attach_sync_funcs`)."""
    ddp_config = ddp_config if ddp_config is not None else default_ddp_config()
    layouts = full_param_layouts(chunks, config, ddp_config)
    model = [
        DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0,
            **({} if layout is None else {"full_param_layout": layout}),
        )
        for i, (chunk, layout) in enumerate(zip(chunks, layouts))
    ]
    attach_sync_funcs(model, config)
    return model


def full_param_layouts(chunks: list, config: TransformerConfig, ddp_config: DistributedDataParallelConfig) -> list:
    """Per chunk, the distributed optimizer's layout of its parameters in DDP's buffers, as
    Megatron-LM's ``wrap_model_chunks_with_ddp`` computes it (megatron-core 0.18 on; DDP without
    one computes the same itself and warns "full_param_layout not provided" on every rank);
    ``None`` for each chunk without the distributed optimizer or on a release whose DDP takes no
    layout. The inputs are DDP's own, from its own process groups: its bucket size
    (``bucket_size``, default ``max(4e7, 1e6 * DP)``; none without ``overlap_grad_reduce``, after
    the first chunk or past the first pipeline stage) and the intra-instance DP x CP and expert-DP
    sizes its buffers shard over."""
    if not ddp_config.use_distributed_optimizer or "full_param_layout" not in _ddp_parameters():
        return [None] * len(chunks)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: PLC0415 (0.18 on)
    from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: PLC0415

    groups = ProcessGroupCollection.setup_process_groups_for_ddp(None, config, ddp_config)
    bucket_size = ddp_config.bucket_size
    if bucket_size is None:
        bucket_size = max(40_000_000, 1_000_000 * groups["dp_group"].size())
    if not ddp_config.overlap_grad_reduce or groups["pp_group"].rank() > 0:
        bucket_size = None
    return [DistributedOptimizer.compute_full_param_layout(
        [p for p in chunk.parameters() if p.requires_grad], bucket_size if i == 0 else None,
        groups["intra_dp_cp_group"].size(), ddp_config,
        expert_data_parallel_world_size=groups["intra_expt_dp_group"].size()) for i, chunk in enumerate(chunks)]


def _ddp_parameters() -> frozenset:
    """The keyword parameters of this release's ``DistributedDataParallel``."""
    return frozenset(inspect.signature(DistributedDataParallel.__init__).parameters)


def _one_or_list(funcs: list):
    return funcs[0] if len(funcs) == 1 else funcs


def attach_sync_funcs(model: list, config: TransformerConfig) -> None:
    """What Megatron-LM's ``train()`` sets on the config for the overlaps, set where the DDP chunks
    are made so that no loop can forget it:

    * ``--overlap-grad-reduce``: ``config.no_sync_func`` (each chunk's ``no_sync``) and
      ``config.grad_sync_func`` (``start_grad_sync``; Megatron-LM's default ``align_grad_reduce``).
      Without ``no_sync_func`` DDP launches a bucket's reduction when it has seen as many gradients
      as in the first step: a later step with more microbatches reduces early and adds the rest into
      an already reduced buffer, silently (../shared/notes/bf16-dist-opt.md: a gradient norm of 1.19
      instead of 1.79).
    * ``--overlap-param-gather`` with ``align_param_gather`` (the interleaved schedule):
      ``config.param_sync_func`` (``start_param_sync``).

    Plain DDP: nothing is set."""
    ddp_config = model[0].ddp_config
    if ddp_config.overlap_grad_reduce:
        config.no_sync_func = _one_or_list([chunk.no_sync for chunk in model])
        config.grad_sync_func = _one_or_list([chunk.start_grad_sync for chunk in model])
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        config.param_sync_func = _one_or_list([chunk.start_param_sync for chunk in model])


def gather_parameters(model: list) -> None:
    """Make every chunk's parameters current before anything reads them between steps.

    With ``overlap_param_gather`` the distributed optimizer updates only this rank's shard, and the
    other ranks' shards arrive in the next forward pass's pre-hooks: until then ``state_dict()``,
    a checksum, a weight export or sync reads stale parameters (0.75% off in the notes' probe). This
    gathers them now (``start_param_sync(force_sync=True)``, as Megatron-LM's
    ``disable_forward_pre_hook`` does before a checkpoint). Elsewhere the parameters are current
    after ``optimizer.step()`` and this does nothing."""
    for chunk in model:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
