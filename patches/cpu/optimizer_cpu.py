"""megatron-core's mixed-precision and distributed optimizers on CPU (fp32, bf16 and fp16 parameters).

WHY
    Both optimizers sort the model's parameters into main-parameter groups by their type string:
    ``param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']`` /
    ``== 'torch.cuda.FloatTensor'``, else ``TypeError``
    (``Float16OptimizerWithFloat16Params.__init__`` in ``optimizer.py``, the optimizer of ``--bf16``
    / ``--fp16`` with plain DDP; ``DistributedOptimizer._build_model_and_main_param_groups`` and
    ``__init__`` in ``distrib_optimizer.py``). A CPU parameter reads ``'torch.FloatTensor'`` /
    ``'torch.BFloat16Tensor'``, so on CPU neither constructor gets past its parameters. The
    distributed optimizer's module also allocates its checkpoint buffers on
    ``torch.cuda.current_device()``. This is what the trainer's and the Megatron-LM entries'
    tests of ``--bf16`` and ``--use-distributed-optimizer`` need on CPU, and what AReaL's and
    NeMo-RL's engines (their default: the distributed optimizer) need there.
    Everything else on these paths (DDP's buffers and bucket groups, the overlapped
    reduce-scatter and all-gather, the fp32 main gradients, clipping, the local multi-tensor
    kernels, the schedules) is covered by ``cpu_gloo``; gloo runs ``reduce_scatter_tensor`` and
    ``all_gather_into_tensor``, sync and async, in fp32 and bf16 (../shared/notes/bf16-dist-opt.md).

HOW (wrappers, never a copy)
    The two constructors run in a torch-function mode in which ``Tensor.type()`` (no argument) of a
    CPU float32, bfloat16 or float16 tensor reads as the CUDA type string, for the duration of that
    call only (the same idea as ``cpu_gloo``'s mode around ``clip_grad_by_total_norm_fp32``); the
    sorting, the fp32 main copies and every later step run unchanged upstream. ``torch`` in
    ``megatron.core.optimizer.distrib_optimizer`` is ``cpu_gloo``'s CPU proxy (its
    ``current_device()`` is the CPU). ``optimizer/grad_scaler.py`` (fp16's and a static loss
    scale's tensors on ``'cuda'``) is not covered: the entries of this project refuse ``--fp16``.

    CPU-only: refuses where CUDA is available (a GPU run uses megatron-core's own code, unchanged).
    Applied by the trainer and the Megatron-LM entries on CPU, and with the AReaL
    (:mod:`megatron_pg_agg.integrations.areal.cpu`) and NeMo-RL (:mod:`megatron_pg_agg.integrations.nemo_rl.cpu`)
    CPU patches.

TARGETS (megatron-core 0.15 to 0.19; the type checks are the same in 0.15.3, 0.16.1, 0.17.1 and 0.19.2)
    ``megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__``;
    ``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__``;
    ``megatron.core.optimizer.distrib_optimizer.torch``.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ...versions import SUPPORTED_MEGATRON_CORE
from .._machinery import Patch, Target
from .cpu_torch import make_torch_proxy, under_mode

NAME = "optimizer_cpu"

_CUDA_TYPE = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
              "torch.HalfTensor": "torch.cuda.HalfTensor"}
"""The type strings the optimizers sort parameters by: a CPU tensor's, and what it reads as here."""


class _CpuFloatingTypesReadAsCuda(TorchFunctionMode):
    """Inside this mode ``Tensor.type()`` (no argument) of a CPU float32, bfloat16 or float16 tensor
    reads as the CUDA type string; every other call is unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE.get(name, name)
        return func(*args, **(kwargs or {}))


def needed(*, cuda: bool, bf16: bool, distributed_optimizer: bool) -> bool:
    """Whether a run needs this stand-in (what every entry asks before applying it): a CPU run with
    megatron-core's mixed-precision (``--bf16``) or distributed optimizer; plain fp32 torch Adam sorts
    no parameter by type, and a GPU run uses megatron-core's own code."""
    return not cuda and (bf16 or distributed_optimizer)


def _cpu_only() -> None:
    if torch.cuda.is_available():
        raise RuntimeError(f"patch {NAME!r} is a CPU-only stand-in for megatron-core's mixed-precision and "
                           "distributed optimizers and refuses to apply when torch.cuda.is_available(); on a GPU "
                           "they run unpatched.")


PATCH = Patch(
    name=NAME,
    supported=SUPPORTED_MEGATRON_CORE,
    why=__doc__,
    precondition=_cpu_only,
    targets=(
        Target("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
               under_mode(_CpuFloatingTypesReadAsCuda)),
        Target("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
               under_mode(_CpuFloatingTypesReadAsCuda)),
        Target("megatron.core.optimizer.distrib_optimizer", "torch", make_torch_proxy()),
    ),
)
