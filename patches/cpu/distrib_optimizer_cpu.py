"""megatron-core's distributed optimizer on CPU (float32 parameters).

WHY
    ``DistributedOptimizer`` (AReaL's default: ``megatron.ddp.use_distributed_optimizer=True``;
    NeMo-RL's: ``policy.megatron_cfg.optimizer.use_distributed_optimizer: true``) sorts the model's
    parameters into main-parameter groups by their type string:
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
    (:mod:`.areal_cpu`) and the NeMo-RL ones (:mod:`.nemo_rl_cpu`).

TARGETS (megatron-core 0.17 to 0.19; the type check is the same in 0.17.1 and 0.19.2)
    ``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__``.
"""
from __future__ import annotations

import torch

from .._machinery import Patch, Target
from ._cpu_torch import under_mode
from .cpu_gloo import _CpuFloatTypeReadsAsCuda

NAME = "distrib_optimizer_cpu"


def _cpu_only() -> None:
    if torch.cuda.is_available():
        raise RuntimeError(f"patch {NAME!r} is a CPU-only stand-in for megatron-core's distributed optimizer and "
                           "refuses to apply when torch.cuda.is_available(); on a GPU it runs unpatched.")


PATCH = Patch(
    name=NAME,
    supported=">=0.17,<0.20",
    why=__doc__,
    precondition=_cpu_only,
    targets=(Target("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
                    under_mode(_CpuFloatTypeReadsAsCuda)),),
    unsupported_reason="written against megatron-core 0.17.1's and 0.19.2's distrib_optimizer.py (AReaL 1.0.4's "
                       "and NeMo-RL's releases here).",
)
