"""megatron-core's distributed optimizer on CPU (float32 parameters).

WHY
    ``DistributedOptimizer`` (AReaL's default: ``megatron.ddp.use_distributed_optimizer=True``)
    sorts the model's parameters into main-parameter groups by their type string:
    ``model_param.type() == 'torch.cuda.FloatTensor'`` (and ``'torch.cuda.HalfTensor'`` /
    ``'torch.cuda.BFloat16Tensor'``) in ``_build_model_and_main_param_groups`` and ``__init__``; a
    CPU parameter reads ``'torch.FloatTensor'``, so the constructor raises ``TypeError``. The
    ``cpu_gloo`` patch covers the rest of the optimizer (``optimizer.py``, ``clip_grads.py``, the
    DDP buffers) but not this module, which its own runs (plain DDP) never build.

HOW (a wrapper, never a copy)
    ``DistributedOptimizer.__init__`` runs in ``cpu_gloo``'s torch-function mode in which
    ``Tensor.type()`` of a CPU float32 tensor reads ``'torch.cuda.FloatTensor'``, for the duration
    of that call only (the same mode ``cpu_gloo`` uses around ``clip_grad_by_total_norm_fp32``).
    Only float32 parameters are covered (a CPU bf16 parameter still reads ``torch.BFloat16Tensor``
    and is refused upstream); the step itself (reduce-scatter, the Adam step on the shard, the
    parameter all-gather) runs unpatched on gloo.

    CPU-only (refuses when CUDA is available); applied with the AReaL CPU patches
    (:func:`.areal_engine_cpu.require_areal_on_cpu`).

TARGETS (megatron-core 0.17)
    ``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__``.
"""
from __future__ import annotations

from .._machinery import Patch, Target
from ._cpu_torch import under_mode
from .areal_engine_cpu import SUPPORTED, require_areal_on_cpu
from .cpu_gloo import _CpuFloatTypeReadsAsCuda

NAME = "distrib_optimizer_cpu"

PATCH = Patch(
    name=NAME,
    supported=SUPPORTED,
    why=__doc__,
    precondition=require_areal_on_cpu(NAME),
    targets=(Target("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
                    under_mode(_CpuFloatTypeReadsAsCuda)),),
    unsupported_reason="written against megatron-core 0.17.1's distrib_optimizer.py (AReaL 1.0.4's release).",
)
