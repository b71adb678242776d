"""NeMo-RL's Megatron training path on a CPU machine: the one entry that applies every stand-in it needs.

    from megatron_pg_agg.integrations.nemo_rl.cpu import apply_nemo_rl_cpu_patches
    apply_nemo_rl_cpu_patches()   # NeMo-RL's checkout on sys.path; before anything imports its worker

What runs is NeMo-RL's own code (0.6.0 @ 7ea279a, a user's checkout on ``sys.path``):
``process_global_batch``, ``get_microbatch_iterator`` (fixed, dynamic batching, sequence packing),
``LossPostProcessor`` with and without ``SequencePackingLossWrapper``, ``megatron_forward_backward``
and, on an instance of ``MegatronPolicyWorkerImpl`` built without Ray, its ``train`` and its split
path (``begin_train_step`` / ``train_microbatch`` / ``finish_train_step``), in megatron-core 0.19.2's
schedule, DDP and (distributed) optimizer, on gloo, in float32, with:

* :mod:`megatron_pg_agg.patches.cpu.cpu_gloo` (megatron-core's CUDA buffers, RNG tracker, synchronisation on the CPU),
* :mod:`megatron_pg_agg.integrations.bridge.cpu.lora_layers` (Megatron-Bridge 0.6.2 imports without Transformer Engine),
* :mod:`megatron_pg_agg.integrations.bridge.cpu.training_loop` (the CUDA spots of Megatron-Bridge's
  training utilities the worker calls after every step),
* :mod:`.mcore_fsdp_adapter_names` (the worker imports ``FullyShardedDataParallelV1/V2``, names of
  megatron-core 0.20; 0.19 has neither),
* :mod:`megatron_pg_agg.patches.cpu.optimizer_cpu` (the distributed optimizer's CUDA type strings),
* :mod:`.cuda_iterator` (the micro-batch iterator's ``.to("cuda")``),
* :mod:`.global_batch_counts` (the step counts' ``.cuda()`` in ``process_global_batch``),
* :mod:`.train_statistics` (``device="cuda"`` of the loss statistics in ``train.py``),
* :mod:`.cp_allgather_backward` (pinned memory and ``.cuda()`` in the context-parallel
  log-prob all-gather's backward),
* :mod:`.policy_worker_cuda` (the worker's own ``device="cuda"``, ``synchronize``,
  ``empty_cache`` and device name).

Each is a :class:`~megatron_pg_agg.patches._machinery.Patch` (version-checked, resolved before
anything is touched, wrappers only, revertible) and refuses to apply when CUDA is available. Context
parallelism also needs a core attention that takes NeMo-RL's CP layout without Transformer Engine:
:class:`.te_cp_thd_attention.CpThdDotProductAttention`, chosen in the model's layer spec (it patches
nothing). Not covered on CPU: Ray, the generation backends, ``setup()``, Transformer Engine layers,
pipeline parallelism with dynamic batching (NeMo-RL refuses it), bf16/fp16.
"""
from __future__ import annotations

from megatron_pg_agg.integrations.bridge.cpu import lora_layers, training_loop
from megatron_pg_agg.integrations.nemo_rl.cpu import (
    cp_allgather_backward,
    cuda_iterator,
    global_batch_counts,
    mcore_fsdp_adapter_names,
    policy_worker_cuda,
    train_statistics,
)
from megatron_pg_agg.patches import _machinery
from megatron_pg_agg.patches.cpu import cpu_gloo, optimizer_cpu

PATCHES = (cpu_gloo.PATCH, lora_layers.PATCH, training_loop.PATCH, mcore_fsdp_adapter_names.PATCH,
           optimizer_cpu.PATCH, cuda_iterator.PATCH,
           global_batch_counts.PATCH,  # before anything imports the worker module
           train_statistics.PATCH, cp_allgather_backward.PATCH,
           policy_worker_cuda.PATCH)  # imports the worker module
"""In application order."""


def apply_nemo_rl_cpu_patches() -> list[str]:
    """Apply every patch of :data:`PATCHES` (:func:`~megatron_pg_agg.patches._machinery.apply_in_order`)."""
    return _machinery.apply_in_order(PATCHES)
