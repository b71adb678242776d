"""Megatron-Bridge on a CPU machine (tests and CPU runs): its stand-ins, applied in one call.

* :mod:`.lora_layers` (patch ``bridge_cpu``): ``megatron.bridge`` imports without Transformer Engine
  (a stand-in for its LoRA layers module) and loads tensor-parallel weights on the CPU;
* :mod:`.training_loop` (patch ``bridge_loop_cpu``): Megatron-Bridge's own training loop
  (``allow_no_cuda``, the CUDA spots of its set-up, loop and loaders).

Both sit on megatron-core's ``cpu_gloo`` (:mod:`megatron_pg_agg.patches.cpu.cpu_gloo`), applied first.
Each refuses to apply where CUDA is available; a GPU node runs Megatron-Bridge as shipped.
"""
from __future__ import annotations

from megatron_pg_agg.integrations.bridge.cpu import lora_layers, training_loop
from megatron_pg_agg.patches import _machinery
from megatron_pg_agg.patches.cpu import cpu_gloo


def apply_bridge_cpu_patches(*, loop: bool = False) -> list[str]:
    """Apply ``cpu_gloo`` and Megatron-Bridge's import stand-in, and with ``loop`` the training
    loop's, in that order (:func:`~megatron_pg_agg.patches._machinery.apply_in_order`)."""
    return _machinery.apply_in_order((cpu_gloo.PATCH, lora_layers.PATCH, *((training_loop.PATCH,) if loop else ())))
