"""Hugging Face checkpoints in and out of megatron-core through Megatron-Bridge.

    hf = open_hf_model("/models/qwen3-0.6b")          # host: folder checks, AutoBridge, provider
    hf.shape                                          # layers, hidden, heads, vocabulary, ...
    chunks = hf.build_chunks(tensor_model_parallel_size=2, ...)   # after parallel_state is set up
    for name, tensor in iter_hf_weights(hf, chunks):  # weight sync to an inference engine
        ...
    save_hf_folder(hf, chunks, "out/hf", rank=dist.get_rank())    # config + safetensors + tokenizer

WHY
    RL users start from a Hugging Face checkpoint and must hand the weights back to their inference
    engine after every update. Megatron-Bridge (``megatron.bridge.AutoBridge``) maps each supported
    family's HF names and layouts onto megatron-core's ``GPTModel`` and back, sharded over TP, PP
    (virtual stages included) and EP. This module uses it for exactly that and nothing else: the
    model is a plain megatron-core ``GPTModel`` per stage, wrapped in megatron-core DDP by the
    caller like every model of the project, trained by the same planner, step runner and loss.

    The shape comes from the HF config (Bridge's provider). What the trainer sets on the provider
    before it builds (:meth:`HFModel.build_chunks`) is the parallel layout and the project's loss
    contract (``calculate_per_token_loss``, no dropout) plus the device's settings: on CPU fp32, the
    fusions off and the local layer spec with the THD core attention
    (:class:`~megatron_pg_agg.megatron.thd_attention.ThdDotProductAttention`: the packed
    microbatches need it); on a GPU with Transformer Engine, Bridge's own TE spec. The vocabulary is
    never padded (``should_pad_vocab`` stays off): a padded row would add probability mass to every
    softmax and the log-probs would no longer be transformers'.

    On CPU the ``bridge_cpu`` patch stands in for the one Megatron-Bridge module that imports
    Transformer Engine at its top (megatron_pg_agg/integrations/bridge/cpu/lora_layers.py).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_pg_agg.data.output_folder import HF_KIND, new_output_folder, replace_output_folder
from megatron_pg_agg.integrations.bridge.hf_folder import (
    HFFolder,
    HFFolderError,
    bridge_install_problem,
    open_hf_folder,
)

logger = logging.getLogger(__name__)

__all__ = ["HFFolderError", "HFModel", "HFShape", "check_weight_names", "iter_hf_weights", "open_hf_model",
           "save_hf_folder"]

MAX_SHARD_BYTES = 5 * 2**30
"""Largest safetensors file :func:`save_hf_folder` writes (transformers' default shard size)."""


@dataclass(frozen=True)
class HFShape:
    """A model's shape as the HF config gives it (read through Megatron-Bridge's provider)."""

    family: str
    """``config.json``'s ``model_type`` (``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ...)."""
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads (grouped-query attention)."""
    vocab_size: int
    """The HF vocabulary: every rollout token id must be below it; megatron-core's is the same."""
    max_position_embeddings: int
    tie_embeddings: bool
    """Input embedding and output layer share one weight (``tie_word_embeddings``)."""
    num_experts: Optional[int]
    """Experts per MoE layer; None for a dense model."""
    router_topk: Optional[int]
    """Experts per token (MoE)."""


class HFModel:
    """One HF causal-LM folder opened through Megatron-Bridge (see the module docstring)."""

    def __init__(self, folder: HFFolder, bridge: Any, provider: Any):
        self.folder = folder
        """The checked folder (:func:`~megatron_pg_agg.integrations.bridge.hf_folder.open_hf_folder`)."""
        self.bridge = bridge
        """Megatron-Bridge's ``AutoBridge`` of the folder."""
        self.provider = provider
        """Its ``GPTModelProvider`` (a megatron-core ``TransformerConfig``), shaped by the HF config;
        read for the shape only (each build takes a fresh one)."""

    @property
    def shape(self) -> HFShape:
        p = self.provider
        experts = p.num_moe_experts or None
        return HFShape(
            family=str(self.folder.config.get("model_type", "?")), num_layers=p.num_layers,
            hidden_size=p.hidden_size, ffn_hidden_size=p.moe_ffn_hidden_size if experts else p.ffn_hidden_size,
            num_attention_heads=p.num_attention_heads, num_query_groups=p.num_query_groups or p.num_attention_heads,
            vocab_size=p.vocab_size, max_position_embeddings=p.seq_length,
            tie_embeddings=bool(p.share_embeddings_and_output_weights), num_experts=experts,
            router_topk=p.moe_router_topk if experts else None)

    def build_chunks(self, **settings) -> list:
        """This rank's ``GPTModel`` chunks (one per virtual pipeline stage) with the folder's
        weights loaded, for the current ``parallel_state``. ``settings``: ``TransformerConfig``
        fields set on the provider before it builds (the parallel sizes, the loss contract, the
        device's settings, the MoE runtime fields); the shape fields are the HF config's and may
        not be given. Not wrapped in DDP (the caller does, as for every model of the project)."""
        from megatron.core.transformer.enums import AttnBackend  # noqa: PLC0415  (megatron-core after the patches)

        from megatron_pg_agg.megatron.model import build_stage_chunks  # noqa: PLC0415

        shape_fields = {"num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                        "vocab_size", "seq_length", "share_embeddings_and_output_weights", "num_moe_experts"}
        given = sorted(shape_fields & set(settings))
        if given:
            raise ValueError(f"the shape comes from the HF config; do not set {given}")
        # a fresh provider per build: finalize() and provide() keep state on it (the process groups
        # of the build), and a batch of runs in one process builds several times
        provider = self.bridge.to_megatron_provider(load_weights=False)
        for name, value in settings.items():
            setattr(provider, name, value)
        provider.should_pad_vocab = False
        provider.attention_backend = AttnBackend.auto
        provider.transformer_layer_spec = _layer_spec
        provider.finalize()
        chunks = build_stage_chunks(provider.provide)
        check_weight_names(self, chunks)
        self.bridge.load_hf_weights(chunks)
        return chunks

    def save(self, model: list, out_dir: str, *, rank: int) -> str:
        """:func:`save_hf_folder` of the live ``model`` (the trainer's ``--save-hf``)."""
        return save_hf_folder(self, model, out_dir, rank=rank)


IGNORED_EXTRA_SUFFIXES = ("rotary_emb.inv_freq",)
"""Tensors an HF folder may hold that transformers itself ignores on load (old rotary buffers)."""


def check_weight_names(hf: HFModel, chunks: list) -> None:
    """Every tensor the model needs is in the folder, and every tensor of the folder is used.

    Megatron-Bridge 0.6.2 only logs a warning for an HF tensor it cannot find, and leaves that
    parameter at its random initialisation; it ignores a tensor no parameter maps to. Both would
    train a model that is not the user's checkpoint. Here the HF names of every parameter of the
    whole model (each rank's chunks through Bridge's mapping registry, gathered over the world)
    are compared with the names in the safetensors headers (nothing is read but the headers).
    Raises :class:`HFFolderError` naming the tensors and the files. Collective: every rank calls it."""
    from megatron.bridge.models.conversion.model_bridge import _megatron_local_name_to_global  # noqa: PLC0415
    from safetensors import safe_open  # noqa: PLC0415

    model_bridge = hf.bridge._model_bridge
    registry = model_bridge.mapping_registry()
    config = chunks[0].config
    tied = bool(config.share_embeddings_and_output_weights)
    needed, unmapped = set(), set()
    for vp_stage, chunk in enumerate(chunks):
        for local_name, _ in chunk.named_parameters():
            name = _megatron_local_name_to_global(chunks, config, model_bridge._unwrap_name(local_name), vp_stage)
            if tied and "output_layer" in name:
                continue  # the embedding's weight (Bridge maps it once)
            mapping = registry.megatron_to_hf_lookup(name)
            if mapping is None:
                unmapped.add(name)
            else:
                needed.update([mapping.hf_param] if isinstance(mapping.hf_param, str) else mapping.hf_param.values())
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (sorted(needed), sorted(unmapped)))
        needed = set().union(*(set(n) for n, _ in gathered))
        unmapped = set().union(*(set(u) for _, u in gathered))
    source = hf.folder.path
    if unmapped:
        raise HFFolderError(f"--hf-model {source}: Megatron-Bridge maps no HF tensor onto the megatron-core "
                            f"parameters {sorted(unmapped)[:8]} (family {hf.shape.family!r})")
    held = {}
    for path in hf.folder.weight_files:
        with safe_open(path, "pt") as f:
            held.update({key: path for key in f.keys()})
    missing = sorted(needed - set(held))
    if missing:
        raise HFFolderError(f"--hf-model {source}: the weights lack {len(missing)} tensor(s) the model needs: "
                            f"{missing[:8]} (looked in {[os.path.basename(p) for p in hf.folder.weight_files]})")
    extra = sorted(k for k in set(held) - needed
                   if not k.endswith(IGNORED_EXTRA_SUFFIXES) and not (tied and k == "lm_head.weight"))
    if extra:
        shown = [f"{k} (in {os.path.basename(held[k])})" for k in extra[:8]]
        raise HFFolderError(f"--hf-model {source}: {len(extra)} tensor(s) of the folder belong to no parameter of "
                            f"the {hf.shape.family!r} model its config describes: {shown}")


def _layer_spec(provider, vp_stage=None):
    """The layer spec the provider builds with: Bridge's default (Transformer Engine's) where TE
    is usable, else megatron-core's local spec for the provider's normalisation, QK layer norm and
    experts, with the THD core attention."""
    from megatron.bridge.models.gpt_provider import default_layer_spec, local_layer_spec  # noqa: PLC0415

    from megatron_pg_agg.megatron.model import te_usable  # noqa: PLC0415
    from megatron_pg_agg.megatron.thd_attention import ThdDotProductAttention  # noqa: PLC0415

    if te_usable():
        return default_layer_spec(provider)
    spec = local_layer_spec(provider)
    spec.submodules.self_attention.submodules.core_attention = ThdDotProductAttention
    return spec


@functools.lru_cache(maxsize=4)
def open_hf_model(path: str) -> HFModel:
    """Open a local HF causal-LM folder through Megatron-Bridge (cached per path: the trainer reads
    the shape at start-up and builds later). Raises :class:`HFFolderError` for a folder that is not
    a causal LM, a missing install, or a family Megatron-Bridge does not map onto a GPT model."""
    folder = open_hf_folder(path)  # the folder first: its problems need no install to be named
    problem = bridge_install_problem()
    if problem is not None:
        raise HFFolderError(f"--hf-model: {problem}")
    if not torch.cuda.is_available():
        from megatron_pg_agg.integrations.bridge.cpu import apply_bridge_cpu_patches  # noqa: PLC0415

        apply_bridge_cpu_patches()
    from megatron.bridge import AutoBridge  # noqa: PLC0415
    from megatron.bridge.models.gpt_provider import GPTModelProvider  # noqa: PLC0415

    try:
        bridge = AutoBridge.from_hf_pretrained(folder.path)
    except (ValueError, KeyError, TypeError) as err:
        raise HFFolderError(f"--hf-model {folder.path} ({', '.join(folder.architectures)}): Megatron-Bridge "
                            f"cannot load it: {err}") from err
    provider = bridge.to_megatron_provider(load_weights=False)
    if not isinstance(provider, GPTModelProvider):
        raise HFFolderError(
            f"--hf-model {folder.path}: family {folder.config.get('model_type')!r} builds a "
            f"{type(provider).__name__}, not a plain megatron-core GPT model with standard attention; the "
            "trainer's THD attention, planner and loss cover GPT models only (Llama, Qwen2, Qwen3, Qwen3-MoE "
            "and other GPT families)")
    if getattr(provider, "multi_latent_attention", False) or getattr(provider, "window_size", None):
        raise HFFolderError(
            f"--hf-model {folder.path}: family {folder.config.get('model_type')!r} uses "
            f"{'multi-latent' if getattr(provider, 'multi_latent_attention', False) else 'sliding-window'} "
            "attention, which the trainer's THD core attention does not implement")
    return HFModel(folder, bridge, provider)


def iter_hf_weights(hf: HFModel, model: list, *, cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The live model's weights in Hugging Face names and layouts, as ``(name, tensor)`` pairs,
    without writing files: the weight sync to an inference engine (vLLM's ``load_weights``,
    SGLang's ``update_weights_from_tensor``). Every rank of the model must iterate it together
    (the tensors are gathered over TP, PP and EP); every rank gets every full tensor. ``model``:
    this rank's chunks, DDP-wrapped or not. ``cpu``: tensors moved to host memory."""
    from megatron.core.utils import unwrap_model  # noqa: PLC0415

    yield from hf.bridge.export_hf_weights(unwrap_model(list(model)), cpu=cpu, show_progress=False)


def save_hf_folder(hf: HFModel, model: list, out_dir: str, *, rank: int,
                   max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """Write the live model as an HF folder at ``out_dir``: the source ``config.json`` (its dtype
    set to the weights'), safetensors (one ``model.safetensors``, or shards and their index), and
    the source folder's tokenizer and generation files. Every rank calls it (the export is
    collective); rank 0 writes.

    Atomic and safe (:mod:`megatron_pg_agg.data.output_folder`): everything goes to a hidden folder
    beside ``out_dir`` with a marker listing its files, which then takes the final name by
    ``os.rename``. Only an earlier output of this function is replaced (its listed files unlinked,
    its folder removed with ``rmdir``); anything else at ``out_dir`` raises
    :class:`~megatron_pg_agg.data.output_folder.OutputFolderError` and is left as it was. A crash at
    any point leaves either the previous folder, or none, under ``out_dir``: never a partial one.
    Returns ``out_dir``."""
    from safetensors.torch import save_file  # noqa: PLC0415  (a dependency of transformers)

    out_dir = os.path.abspath(out_dir)
    writer = rank == 0
    temp = new_output_folder(out_dir) if writer else None
    shards, current, size, dtype = [], {}, 0, None
    try:
        for tensor_name, tensor in iter_hf_weights(hf, model):
            if not writer:
                continue
            dtype = dtype or tensor.dtype
            nbytes = tensor.numel() * tensor.element_size()
            if current and size + nbytes > max_shard_bytes:
                shards.append(_write_shard(save_file, temp, len(shards), current))
                current, size = {}, 0
            current[tensor_name] = tensor.contiguous()
            size += nbytes
        if writer:
            if current or not shards:
                shards.append(_write_shard(save_file, temp, len(shards), current))
            _finish_folder(hf.folder, temp, shards, dtype)
            replace_output_folder(temp, out_dir, kind=HF_KIND, flag="--save-hf")
    except BaseException:
        if writer:
            shutil.rmtree(temp, ignore_errors=True)
        raise
    if dist.is_initialized():
        dist.barrier()
    return out_dir


def _write_shard(save_file, temp: str, index: int, tensors: dict) -> tuple:
    path = os.path.join(temp, f"shard-{index:05d}.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    return path, sorted(tensors)


def _finish_folder(source: HFFolder, temp: str, shards: list, dtype) -> None:
    """Name the shards as transformers does, write the index (several shards), the config with the
    weights' dtype, and copy the tokenizer and generation files."""
    if len(shards) == 1:
        os.rename(shards[0][0], os.path.join(temp, "model.safetensors"))
    else:
        weight_map = {}
        for i, (path, names) in enumerate(shards):
            final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            os.rename(path, os.path.join(temp, final))
            weight_map.update({n: final for n in names})
        with open(os.path.join(temp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    config = dict(source.config)
    if dtype is not None:
        key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
        config[key] = str(dtype).removeprefix("torch.")
    with open(os.path.join(temp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in source.tokenizer_files:
        shutil.copy2(os.path.join(source.path, name), os.path.join(temp, name))
    for name in os.listdir(temp):
        with open(os.path.join(temp, name), "rb") as f:
            os.fsync(f.fileno())
