"""Megatron-Bridge on CPU: import ``megatron.bridge`` without Transformer Engine.

WHY
    ``from megatron.bridge import AutoBridge`` imports the PEFT package, whose
    ``megatron/bridge/peft/lora_layers.py`` does ``import transformer_engine.pytorch as te`` at its
    top (megatron-bridge 0.6.2). Transformer Engine needs CUDA, so on a CPU machine the whole of
    Megatron-Bridge fails to import, although nothing on the HF <-> megatron-core path (AutoBridge,
    the model providers, the weight mappings, export) touches LoRA. The HF import/export path itself
    runs on CPU once that one module imports, except for one spot: loading a tensor-parallel
    weight, ``param_mapping`` moves the HF tensor to ``torch.cuda.current_device()`` before the TP
    broadcast (``ColumnParallelMapping``/``RowParallelMapping.hf_to_megatron``, megatron-bridge
    0.6.2). The rest of the CUDA-only spots it meets are megatron-core's, covered by ``cpu_gloo``.

HOW
    A :class:`~megatron_pg_agg.patches._machinery.StandIn` for ``megatron.bridge.peft.lora_layers``,
    put in ``sys.modules`` only where importing the real module fails for the missing
    ``transformer_engine`` (any other import error is raised). It defines the names the PEFT modules
    import from it (:data:`LORA_NAMES`) as classes that refuse to be built, naming the reason:
    LoRA through Megatron-Bridge needs Transformer Engine. Nothing else is replaced: no fake
    ``transformer_engine`` module is made (megatron-core decides whether TE is usable from its
    presence). ``torch`` in ``param_mapping``'s namespace is the CPU proxy of ``cpu_gloo``
    (``torch.cuda.current_device()`` is the CPU device there, nothing else differs). Reverting
    removes the stand-in and restores the module's ``torch``.

    CPU-only (like ``cpu_gloo``): it refuses to apply when CUDA is available; a GPU node runs
    Megatron-Bridge with Transformer Engine installed (the ``te`` extra). It also refuses a
    megatron-bridge outside :data:`SUPPORTED_BRIDGE`: the stand-in's names are those of that release.

TARGETS (megatron-core 0.19, megatron-bridge 0.6.x)
    stand-in: ``megatron.bridge.peft.lora_layers`` (missing ``transformer_engine``);
    ``megatron.bridge.models.conversion.param_mapping.torch`` (the CPU torch proxy).
"""
from __future__ import annotations

import types

import torch

from megatron_pg_agg.patches._machinery import StandIn, Target, patch_family, require_distribution
from megatron_pg_agg.patches.cpu.cpu_torch import make_torch_proxy

NAME = "bridge_cpu"
SUPPORTED = ">=0.19,<0.20"
"""megatron-core releases: megatron-bridge 0.6.x requires megatron-core 0.19."""
SUPPORTED_BRIDGE = ">=0.6,<0.7"
"""megatron-bridge releases the stand-in was written against (0.6.2 tested)."""
LORA_LAYERS = "megatron.bridge.peft.lora_layers"
PARAM_MAPPING = "megatron.bridge.models.conversion.param_mapping"
LORA_NAMES = ("LinearAdapter", "LoRALinear", "LoRATopKRouter", "TEFusedLoRALinear")
"""What ``megatron.bridge.peft.lora`` and ``canonical_lora`` import from ``lora_layers`` (0.6.2)."""


def _lora_layers_stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name, "Stand-in (megatron_pg_agg bridge_cpu): LoRA layers need Transformer Engine.")

    def refuse(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__name__}: LoRA through Megatron-Bridge needs Transformer Engine (a GPU); "
                           f"megatron_pg_agg's bridge_cpu patch stands in for {name} on CPU")

    for leaf in LORA_NAMES:
        setattr(module, leaf, type(leaf, (), {"__new__": refuse, "__module__": name}))
    return module


RESILIENCY = "nvidia_resiliency_ext"
RESILIENCY_INPROCESS = "nvidia_resiliency_ext.inprocess"


def _resiliency_stand_in(name: str) -> types.ModuleType:
    """``nvidia_resiliency_ext`` (a package) and its ``inprocess`` module: Bridge's ``pretrain.py``
    imports ``CallWrapper`` at its top for a type annotation only; in-process restart, the one
    feature that uses it, stays off (``ConfigContainer.inprocess_restart`` None)."""
    module = types.ModuleType(name, "Stand-in (megatron_pg_agg bridge_cpu): nvidia-resiliency-ext is not installed.")
    if name == RESILIENCY:
        module.__path__ = []  # a package: its inprocess submodule is stood in too
    else:
        def refuse(cls, *args, **kwargs):
            raise RuntimeError("in-process restart needs nvidia-resiliency-ext (not installable from the index; "
                               "megatron_pg_agg's bridge_cpu patch stands in for it on CPU)")

        module.CallWrapper = type("CallWrapper", (), {"__new__": refuse, "__module__": name})
    return module


def installed_bridge_version() -> str | None:
    """The installed megatron-bridge distribution's version; None without one."""
    import importlib.metadata  # noqa: PLC0415  (metadata only: megatron.bridge itself is not imported)

    try:
        return importlib.metadata.version("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_cpu_and_bridge(name: str):
    """A precondition for the Megatron-Bridge CPU patch ``name``: no CUDA, megatron-bridge in range."""

    def precondition() -> None:
        if torch.cuda.is_available():
            raise RuntimeError(
                f"patch {name!r} is a CPU-only stand-in and refuses to apply when torch.cuda.is_available(); "
                "on a GPU install Transformer Engine (pip install -e '.[te]') and Megatron-Bridge imports unpatched.")
        require_distribution(name, "megatron-bridge", installed_bridge_version(), SUPPORTED_BRIDGE)

    return precondition


stand_in = patch_family(
    supported=SUPPORTED, refusal=require_cpu_and_bridge,
    unsupported_reason="megatron-bridge 0.6 is built on megatron-core 0.19 (its Requires-Dist); install 0.19.x.")
"""The ``Patch`` maker of every Megatron-Bridge CPU stand-in (one release range, one refusal)."""

PATCH = stand_in(NAME, __doc__, Target(PARAM_MAPPING, "torch", make_torch_proxy()),
                 stand_ins=(StandIn(LORA_LAYERS, "transformer_engine", _lora_layers_stand_in),
                            StandIn(RESILIENCY, RESILIENCY, _resiliency_stand_in),
                            StandIn(RESILIENCY_INPROCESS, RESILIENCY, _resiliency_stand_in)))
