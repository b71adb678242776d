"""mbridge's GPT model on CPU: megatron-core's local layers with the project's THD attention.

WHY
    AReaL 1.0.4 builds its Megatron model through mbridge 0.15.1 (``bridge_type="mbridge"``, the
    default). mbridge assumes Transformer Engine and CUDA in three spots:

    * ``LLMBridge._get_transformer_layer_spec`` asks megatron-core for the Transformer Engine layer
      spec (``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``): no TE on CPU.
      megatron-core's local spec builds, but its ``DotProductAttention`` refuses packed sequences
      (``packed_seq_params`` must be None), and AReaL always feeds packed THD micro-batches.
    * mbridge's weight names are TE's: the input and pre-MLP norms are fused into the linear layers
      (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``); the
      local spec has them as ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight``, which no
      mapping of mbridge knows (``NotImplementedError: Unsupported parameter name``).
    * ``mbridge.core.util.get_model`` moves every chunk with
      ``model_module.cuda(torch.cuda.current_device())``.

HOW (wrappers only, never a copy of an upstream function)
    * ``get_gpt_decoder_block_spec`` as ``mbridge.core.llm_bridge`` imported it: called with
      ``use_transformer_engine=False`` (megatron-core's local spec for the same config), and each
      layer's core attention made :class:`megatron_pg_agg.megatron.thd_attention.ThdDotProductAttention`
      (the project's packed-THD attention without TE; it subclasses the local one, adds no
      parameter, and only builds the block-diagonal causal mask).
    * ``Bridge._weight_name_mapping_mcore_to_hf``: a local-spec name is renamed to its TE name
      before the original maps it (``input_layernorm.weight`` ->
      ``self_attention.linear_qkv.layer_norm_weight``, ``pre_mlp_layernorm.weight`` ->
      ``mlp.linear_fc1.layer_norm_weight``: the same tensor, one model-independent rename, so every
      model's mapping of mbridge applies unchanged).
    * ``torch`` in ``mbridge.core.util`` is the CPU proxy of
      :mod:`megatron_pg_agg.patches.cpu.cpu_torch` (the current CUDA device is the CPU), and
      ``get_model`` as ``mbridge.core.bridge`` imported it runs in a
      torch-function mode in which ``Tensor.cuda()`` is the identity (for that call only).

    CPU-only (refuses when CUDA is available), areal 1.0.4 and mbridge 0.15.x
    (:func:`.megatron_engine.require_areal_on_cpu`). Dense LLMs that use ``LLMBridge``'s layer
    spec (Llama, Qwen2, Qwen3) are covered; mbridge models with their own spec (MoE, VL) are not.

TARGETS (megatron-core 0.17, mbridge 0.15.1)
    ``mbridge.core.llm_bridge.get_gpt_decoder_block_spec``;
    ``mbridge.core.bridge.Bridge._weight_name_mapping_mcore_to_hf``;
    ``mbridge.core.util.torch``; ``mbridge.core.bridge.get_model``.
"""
from __future__ import annotations

import inspect

from megatron_pg_agg.integrations.areal.cpu.megatron_engine import stand_in
from megatron_pg_agg.patches._machinery import Target
from megatron_pg_agg.patches.cpu.cpu_torch import _TensorCudaIsIdentity, make_torch_proxy, under_mode

NAME = "mbridge_cpu"
LOCAL_TO_TE_NAMES = (
    (".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
    (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"),
)
"""megatron-core local-spec parameter suffix -> the fused TE name mbridge maps (the same tensor)."""


def _make_block_spec(original):
    signature = inspect.signature(original)

    def get_gpt_decoder_block_spec(*args, **kwargs):
        from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: PLC0415

        from megatron_pg_agg.megatron.thd_attention import ThdDotProductAttention  # noqa: PLC0415

        bound = signature.bind(*args, **kwargs)
        bound.arguments["use_transformer_engine"] = False
        spec = original(*bound.args, **bound.kwargs)
        for layer in spec.layer_specs:
            attention = layer.submodules.self_attention.submodules
            if attention.core_attention is DotProductAttention:
                attention.core_attention = ThdDotProductAttention
        return spec

    return get_gpt_decoder_block_spec


def _make_name_mapping(original):
    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name, *args, **kwargs):
        for local, te in LOCAL_TO_TE_NAMES:
            if mcore_weights_name.endswith(local):
                mcore_weights_name = mcore_weights_name[: -len(local)] + te
                break
        return original(self, mcore_weights_name, *args, **kwargs)

    return _weight_name_mapping_mcore_to_hf


PATCH = stand_in(
    NAME, __doc__,
    Target("mbridge.core.llm_bridge", "get_gpt_decoder_block_spec", _make_block_spec),
    Target("mbridge.core.bridge", "Bridge._weight_name_mapping_mcore_to_hf", _make_name_mapping),
    Target("mbridge.core.util", "torch", make_torch_proxy()),
    Target("mbridge.core.bridge", "get_model", under_mode(_TensorCudaIsIdentity)),
)
