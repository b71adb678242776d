"""The tiny models of the parity check and the tests (CPU-sized; never the trainer's model).

* :func:`tiny_transformer_config`: :func:`megatron_pg_agg.megatron.model.transformer_config` with tiny
  sizes (4 layers, hidden 32, 4 heads); fusions follow the device like the trainer's.
* :class:`PerTokenLM`: a model with no cross-token interaction, for context parallelism on CPU.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_pg_agg.megatron.model import build_model_chunks, transformer_config

from .fixture import MAX_SEQ_LEN, MOE_AUX_COEFF, MOE_TOPK, MOE_Z_COEFF, MTP_FACTOR, MTP_LAYERS, NUM_LAYERS, VOCAB

TINY_SIZES = dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4)
"""Sizes of every tiny model unless overridden: small enough for several gloo ranks on 2 cores."""

__all__ = ["PerTokenLM", "TINY_SIZES", "tiny_transformer_config"]


def tiny_transformer_config(**overrides) -> TransformerConfig:
    """A tiny ``TransformerConfig`` (:data:`TINY_SIZES`); ``overrides`` win. Pass the parallel
    sizes here; they must match ``parallel_state``."""
    return transformer_config(**{**TINY_SIZES, **overrides})


class PerTokenLM(torch.nn.Module):
    """A language model with no cross-token interaction: logits_t depend on token_t only.

    It stands in for GPTModel where attention would need Transformer Engine (context parallelism
    on CPU): with a per-token model, a CP shard of a sequence is computed exactly as in the whole
    sequence, so a CP run isolates what the loss side does with sharded tokens (weights, counts,
    the DP x CP reductions, the sequence statistic of gspo/gmpo). Same call signature as
    GPTModel; logits ``[1, T, V]`` (TP = 1).
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, hidden_size: int = 32):
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.embedding = torch.nn.Embedding(vocab_size, hidden_size)
        self.mix = torch.nn.Linear(hidden_size, hidden_size)
        self.output_layer = torch.nn.Linear(hidden_size, vocab_size)

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline hook; this model only runs with PP = 1."""

    def forward(self, input_ids, position_ids=None, attention_mask=None, packed_seq_params=None, **_):
        hidden = torch.tanh(self.mix(self.embedding(input_ids)))
        return self.output_layer(hidden)


def _moe_kwargs(case, router_losses: bool) -> dict:
    if not case.experts:
        return {}
    return dict(num_moe_experts=case.experts, moe_router_topk=MOE_TOPK,
                moe_aux_loss_coeff=MOE_AUX_COEFF if router_losses else 0.0,
                moe_z_loss_coeff=MOE_Z_COEFF if router_losses else None,
                expert_model_parallel_size=case.ep, moe_token_dispatcher_type=case.dispatcher,
                add_bias_linear=False)  # megatron-core 0.16 experts cannot add a bias (see check_megatron_config)


def build_case_model(case, *, per_token_loss: bool = True, router_losses: bool = True):
    """``(config, chunks)``: this rank's chunks of the case's model (GPT, MoE GPT or PerTokenLM)
    for the current ``parallel_state``, initialised from one seed (the same weights on every
    rank before :func:`load_full_state` puts the reference's in)."""
    mtp = dict(mtp_num_layers=MTP_LAYERS, mtp_loss_scaling_factor=MTP_FACTOR) if case.mtp else {}
    config = tiny_transformer_config(
        **_moe_kwargs(case, router_losses),
        **mtp,
        num_layers=NUM_LAYERS,
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=case.vpp,
        context_parallel_size=case.cp,
        # 1F1B exchanges shapes per microbatch; the interleaved schedule gets uniform packs
        variable_seq_lengths=case.pp > 1 and not case.uniform_tokens,
        calculate_per_token_loss=per_token_loss,
    )
    torch.manual_seed(1234)
    if case.per_token_model:
        chunks = [PerTokenLM(config, VOCAB)]
    else:
        chunks = build_model_chunks(config, VOCAB, MAX_SEQ_LEN, share_embeddings_and_output_weights=False)
    if torch.cuda.is_available():  # NCCL run on a GPU node: weights built on the CPU, then moved
        chunks = [c.cuda() for c in chunks]
    return config, chunks


def full_parameter_name(module, name: str) -> str:
    """Local parameter name -> the single-device model's name (pipeline layers renumbered, local
    experts numbered globally)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        layer = module.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)
    if "local_experts" in parts:  # expert parallelism: local expert k of EP rank r is r * local + k
        k = parts.index("local_experts") + 1
        local = len(module.decoder.layers[0].mlp.experts.local_experts)
        parts[k] = str(parallel_state.get_expert_model_parallel_rank() * local + int(parts[k]))
    return ".".join(parts)


def full_named_tensors(ddp_chunks, tensors_of) -> dict:
    """``{single-device name: tensor}`` over this rank's DDP chunks, where ``tensors_of(chunk)``
    gives ``{parameter: tensor}`` (a gradient, a weight): tensor-parallel shards joined along the
    parameter's partition dimension (a collective over the TP group: every rank calls it at the
    same point), pipeline-local names renamed (:func:`full_parameter_name`), tensors on the host.
    A parameter ``tensors_of`` leaves out is skipped. A model inside Megatron's ``Float16Module``
    (``--bf16``) is named as the model itself."""
    tp_rank, tp_size, tp_group = tp_rank_size_group()
    out = {}
    for chunk in ddp_chunks:
        tensors = tensors_of(chunk)
        module = chunk.module
        if isinstance(module, Float16Module):
            module = module.module
        for name, param in module.named_parameters():
            if param not in tensors:
                continue
            tensor = tensors[param]
            if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
                parts = [torch.empty_like(tensor) for _ in range(tp_size)]
                torch.distributed.all_gather(parts, tensor.contiguous(), group=tp_group)
                tensor = torch.cat(parts, dim=param.partition_dim)
            out[full_parameter_name(module, name)] = tensor.cpu()
    return out


def tp_rank_size_group():
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_group())


def load_full_state(chunks, full_state: dict) -> None:
    """Copy single-device weights into this rank's (TP-sharded, PP-split) chunks."""
    tp_rank, tp_size, _ = tp_rank_size_group()
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                full = full_state[full_parameter_name(chunk, name)]
                if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
                    full = full.chunk(tp_size, dim=param.partition_dim)[tp_rank]
                if full.shape != param.shape:
                    raise RuntimeError(f"{name}: shard {tuple(full.shape)} != parameter {tuple(param.shape)}")
                param.copy_(full.to(param.device))
