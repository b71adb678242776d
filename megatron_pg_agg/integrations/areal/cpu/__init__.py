"""AReaL 1.0.4's Megatron engine on a CPU machine: the one entry that applies every stand-in it needs.

    from megatron_pg_agg.integrations.areal.cpu import apply_areal_cpu_patches
    apply_areal_cpu_patches()   # before anything imports areal.engine.megatron_engine's model code

What runs is AReaL's own ``MegatronPPOActor`` (its config dataclasses, ``create_process_group``,
``initialize``, mbridge's model build and weight load, ``compute_advantages``, ``ppo_update``,
``train_batch``, megatron-core's schedule, DDP and distributed optimizer) on gloo, in float32, with:

* :mod:`megatron_pg_agg.patches.cpu.cpu_gloo` (megatron-core's CUDA buffers, RNG tracker, synchronisation on the CPU),
* :mod:`.megatron_engine` (``megatron.bridge`` stood in; the engine's device is the CPU),
* :mod:`.mbridge_pins` (mbridge 0.15.1 vs megatron-core 0.17 / transformers 5: AReaL's own pins),
* :mod:`.mbridge_layers` (megatron-core's local layers with the project's THD attention, their
  parameter names, no ``.cuda()``),
* :mod:`.mbridge_dtype` (AReaL's ``dtype`` reaches mbridge's config),
* :mod:`megatron_pg_agg.patches.cpu.optimizer_cpu` (the distributed optimizer's CUDA type strings).

Each is a :class:`~megatron_pg_agg.patches._machinery.Patch` (version-checked, resolved before
anything is touched, wrappers only, revertible with ``revert_megatron_patches()``) and refuses to
apply when CUDA is available. Not covered on CPU: context parallelism and sequence parallelism
(Transformer Engine), bf16/fp16 with the distributed optimizer, gradient checkpointing, MoE and
VL models, ``bridge_type="megatron-bridge"``, LoRA, tree training.
"""
from __future__ import annotations

from megatron_pg_agg.integrations.areal.cpu import mbridge_dtype, mbridge_layers, mbridge_pins, megatron_engine
from megatron_pg_agg.patches import _machinery
from megatron_pg_agg.patches.cpu import cpu_gloo, optimizer_cpu

PATCHES = (cpu_gloo.PATCH, megatron_engine.PATCH, mbridge_pins.PATCH, mbridge_layers.PATCH, mbridge_dtype.PATCH,
           optimizer_cpu.PATCH)
"""In application order (``areal_engine_cpu`` stands in ``megatron.bridge`` before any target in
``areal.engine.megatron_engine`` is resolved)."""


def apply_areal_cpu_patches() -> list[str]:
    """Apply every patch of :data:`PATCHES` (:func:`~megatron_pg_agg.patches._machinery.apply_in_order`)."""
    return _machinery.apply_in_order(PATCHES)
