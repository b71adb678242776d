"""AReaL's Megatron engine module on CPU: import it without Megatron-Bridge, and use the CPU device.

WHY
    ``areal.engine.megatron_engine`` (areal 1.0.4) imports ``megatron.bridge`` (``AutoBridge``) and
    ``megatron.bridge.peft.lora`` (``LoRA``) at its top, although its default ``bridge_type`` is
    ``"mbridge"`` and Megatron-Bridge is used only for ``bridge_type="megatron-bridge"`` and LoRA.
    Megatron-Bridge does not import on a CPU machine (its PEFT layers import Transformer Engine;
    AReaL's pin, megatron-bridge 0.4.0, also wants nvidia-modelopt, mamba-ssm and other CUDA
    builds), so without it AReaL's Megatron engine cannot even be imported. Then
    ``MegatronEngine.initialize`` takes its device as ``torch.device(int(LOCAL_RANK))``, a CUDA
    ordinal whatever the platform (``current_platform``, which AReaL resolves to its own
    ``CpuPlatform`` here, is used everywhere else), and builds the model under ``with self.device``
    and moves every micro-batch there.

HOW (stand-ins and a namespace proxy; nothing of AReaL's code is copied)
    * :class:`~megatron_pg_agg.patches._machinery.StandIn` modules for ``megatron.bridge``,
      ``megatron.bridge.peft`` and ``megatron.bridge.peft.lora``, put in ``sys.modules`` only where
      the real ``megatron.bridge`` is not installed (any other import error is raised). They define
      the two names AReaL imports (``AutoBridge``, ``LoRA``) as classes that refuse to be used,
      naming the reason: ``bridge_type="megatron-bridge"`` and LoRA need Megatron-Bridge, which
      needs Transformer Engine. With Megatron-Bridge installed nothing is stood in.
    * ``torch`` in ``areal.engine.megatron_engine``'s namespace is the CPU proxy of
      :mod:`megatron_pg_agg.patches.cpu.cpu_torch` (a CUDA ``device`` argument of a factory lands on
      the CPU, the current CUDA device is the CPU), whose ``device(...)`` also maps a CUDA device (a bare ordinal,
      ``"cuda"``, ``"cuda:N"``) to the CPU. Every other attribute is the real ``torch``.

    CPU-only: refuses to apply when ``torch.cuda.is_available()``. It also refuses an areal outside
    ``actor_patch.SUPPORTED_AREAL`` and an mbridge outside :data:`SUPPORTED_MBRIDGE` (the releases
    the AReaL CPU patches were written against; :func:`require_areal_on_cpu`, shared by them).

TARGETS (megatron-core 0.17, areal 1.0.4, mbridge 0.15.1)
    stand-ins: ``megatron.bridge``, ``megatron.bridge.peft``, ``megatron.bridge.peft.lora``
    (missing ``megatron.bridge``); ``areal.engine.megatron_engine.torch``.
"""
from __future__ import annotations

import types

import torch

from megatron_pg_agg.patches._machinery import StandIn, Target, patch_family, require_distribution
from megatron_pg_agg.patches.cpu.cpu_torch import _is_cuda_device, make_torch_proxy

NAME = "areal_engine_cpu"
SUPPORTED = ">=0.17,<0.18"
"""megatron-core releases: AReaL 1.0.4 pins 0.17.0; 0.17.1 tested."""
SUPPORTED_MBRIDGE = ">=0.15.1,<0.16"
"""mbridge releases (AReaL 1.0.4 pins 0.15.1, tested)."""
ENGINE = "areal.engine.megatron_engine"
BRIDGE = "megatron.bridge"
BRIDGE_MODULES = (BRIDGE, "megatron.bridge.peft", "megatron.bridge.peft.lora")
"""Parents first: each is imported (and stood in) after the one before it."""
STOOD_IN_NAMES = {BRIDGE: ("AutoBridge",), "megatron.bridge.peft.lora": ("LoRA",)}
"""What ``areal.engine.megatron_engine`` imports from the stood-in modules (areal 1.0.4)."""


def require_areal_on_cpu(name: str):
    """A precondition for the AReaL CPU patch ``name``: no CUDA, areal and mbridge in range."""

    def precondition() -> None:
        from megatron_pg_agg.integrations.areal.actor_patch import areal_problem  # noqa: PLC0415
        from megatron_pg_agg.versions import distribution_version  # noqa: PLC0415

        if torch.cuda.is_available():
            raise RuntimeError(f"patch {name!r} is a CPU-only stand-in for AReaL's Megatron engine and refuses to "
                               f"apply when torch.cuda.is_available(); on a GPU AReaL runs unpatched.")
        problem = areal_problem()
        if problem is not None:
            raise RuntimeError(f"patch {name!r}: {problem}; nothing was patched.")
        require_distribution(name, "mbridge", distribution_version("mbridge"), SUPPORTED_MBRIDGE)

    return precondition


stand_in = patch_family(
    supported=SUPPORTED, refusal=require_areal_on_cpu,
    unsupported_reason="AReaL 1.0.4 pins megatron-core 0.17.0; these stand-ins were tested with 0.17.1.")
"""The ``Patch`` maker of every AReaL CPU stand-in (one release range, one refusal)."""


def _bridge_stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"Stand-in (megatron_pg_agg {NAME}): Megatron-Bridge is not installed.")
    if name != BRIDGE_MODULES[-1]:
        module.__path__ = []  # a package: its submodules are stood in too

    def refuse(cls, *args, **kwargs):
        raise RuntimeError(f"{name}.{cls.__name__}: AReaL's bridge_type='megatron-bridge' and LoRA need "
                           f"Megatron-Bridge (and Transformer Engine, a GPU); megatron_pg_agg's {NAME} patch "
                           f"stands in for it on CPU, where AReaL builds its model with mbridge")

    for leaf in STOOD_IN_NAMES.get(name, ()):
        setattr(module, leaf, type(leaf, (), {"__new__": refuse, "from_hf_pretrained": classmethod(refuse),
                                              "__module__": name}))
    return module


def _make_engine_torch(original):
    proxy = make_torch_proxy()(original)
    real_device = original.device

    def device(*args, **kwargs):
        if len(args) == 1 and not kwargs and _is_cuda_device(args[0]):
            return real_device("cpu")
        return real_device(*args, **kwargs)

    proxy.device = device
    return proxy


PATCH = stand_in(NAME, __doc__, Target(ENGINE, "torch", _make_engine_torch),
                 stand_ins=tuple(StandIn(m, BRIDGE, _bridge_stand_in) for m in BRIDGE_MODULES))
