"""CPU/gloo shim for Megatron-LM's training side: ``pretrain()`` runs on a CPU-only machine.

WHY
    ``megatron.training`` (Megatron-LM's loop, initialisation, logging, checkpointing) assumes a
    GPU in a handful of places that only set up, time or log, and are harmless to redirect on a
    CPU: step counters and flags are made with ``device='cuda'``, memory statistics and streams
    are read, the C++ dataset helpers and the legacy fused kernels are compiled with ``make`` and
    ``nvcc``, a JIT warm-up runs CUDA kernels (11 s of torch.compile on CPU), the model is moved
    with ``Module.cuda()``, and initialisation asserts CUDA and initialises model parallelism only
    when ``torch.cuda.device_count() > 0``. One module it imports,
    ``megatron.core.transformer.custom_layers.batch_invariant_kernels``, imports triton (a
    ~286 MB GPU compiler) at its top only to offer a GPU mode. With this patch and :mod:`.cpu_gloo`, Megatron-LM's
    own ``pretrain()`` trains on CPU with gloo, so the Megatron-LM integration is tested for real
    in CI. It is CPU-only: it refuses to apply when ``torch.cuda.is_available()``.

HOW (wrappers only, never a copy of an upstream function)
    * ``torch`` in the namespace of each module in :data:`TORCH_PROXY_MODULES` is the CPU proxy of
      :mod:`.cpu_torch` in its ``training`` form: CUDA factories land on the CPU, the current
      device is the CPU, ``device_count()`` is 1, streams/``set_device``/``empty_cache`` are
      no-ops, memory statistics are 0, and the CUDA RNG state is the CPU generator's.
    * ``megatron.training.training.initialize_megatron`` is called with ``allow_no_cuda=True``.
    * ``megatron.training.training.get_model`` runs under a torch-function mode in which
      ``Tensor.cuda()`` is the identity (``Module.cuda()`` moves parameters with it).
    * ``megatron.training.initialize._warmup_jit_function`` does nothing (CUDA kernels only).
    * ``megatron.legacy.fused_kernels.load`` does nothing (it runs ``$CUDA_HOME/bin/nvcc``;
      the module exists up to core_v0.16).
    * ``megatron.core.datasets.utils.compile_helpers`` skips ``make`` when the installed
      ``helpers_cpp`` extension imports (the package ships it built, without its sources).
    * A stand-in for ``batch_invariant_kernels`` (only when triton is missing): batch-invariant
      mode reads as off, and turning it on raises with a message saying it needs triton on a GPU.

TARGETS: see :data:`PATCH` (megatron-core 0.15.x-0.19.x with the Megatron-LM checkout of the same
minor release, recognised by :mod:`.._megatron_lm_release`; targets that exist only in some releases
name their range). Apply :mod:`.cpu_gloo` too: this patch covers only the training side.
"""
from __future__ import annotations

import contextlib
import functools
import types

import torch

from ...versions import SUPPORTED_MEGATRON_CORE
from .._machinery import Patch, StandIn, Target
from .._megatron_lm_release import check_checkout
from .cpu_torch import _TensorCudaIsIdentity, make_torch_proxy, under_mode

NAME = "megatron_lm_cpu"
SUPPORTED = SUPPORTED_MEGATRON_CORE

TORCH_PROXY_MODULES: tuple[str, ...] = (
    "megatron.training.initialize",  # device_count gates mpu init and RNG seeding; set_device
    "megatron.training.training",  # device='cuda' flags and counters, streams, empty_cache, memory stats
    "megatron.training.checkpointing",  # iteration tensor, CUDA RNG state saved and restored
    "megatron.core.timers",  # barrier timers: device='cuda' buffers
    "megatron.core.rerun_state_machine",  # CUDA RNG state around reruns
    # Megatron-LM's default checkpoint format (torch_dist) saves through these
    "megatron.core.dist_checkpointing.strategies.filesystem_async",  # synchronize before the write
    "megatron.core.dist_checkpointing.strategies.fully_parallel",  # synchronize
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # device='cuda' flags
    "megatron.core.dist_checkpointing.strategies.async_utils",  # synchronize, liveness flags
    "megatron.core.dist_checkpointing.exchange_utils",  # empty_like(device='cuda') buffers
)

TRAINING_UTILS = ("megatron.training.utils", "<0.18")
"""Grad-norm and stat buffers, the memory report: a module until core_v0.17, then the package
``megatron.training.utils`` whose functions live in ``utils.common_utils`` (the package's own
``torch`` would proxy nothing)."""
TRAINING_COMMON_UTILS = ("megatron.training.utils.common_utils", ">=0.18")

BATCH_INVARIANT_KERNELS = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def _batch_invariant_stand_in(name: str) -> types.ModuleType:
    """The names Megatron-LM imports from ``batch_invariant_kernels``, for a machine without
    triton: the mode is off and cannot be turned on."""
    module = types.ModuleType(name, "CPU stand-in (megatron_pg_agg patch megatron_lm_cpu): "
                                    "batch-invariant mode needs triton and a GPU.")

    def refuse(*args, **kwargs):
        raise RuntimeError("--batch-invariant-mode needs triton and a GPU; this CPU run has the "
                           "megatron_lm_cpu stand-in in place of batch_invariant_kernels")

    module.is_batch_invariant_mode_enabled = lambda: False
    module.enable_batch_invariant_mode = refuse
    module.set_batch_invariant_mode = lambda enabled=True: refuse() if enabled else None
    module.disable_batch_invariant_mode = lambda: None
    return module


def _make_allow_no_cuda(original):
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return initialize_megatron


def _make_noop(original):
    @functools.wraps(original)
    def noop(*args, **kwargs):
        return None

    return noop


def _make_compile_helpers(original):
    def compile_helpers():
        with contextlib.suppress(ImportError):
            from megatron.core.datasets import helpers_cpp  # noqa: F401, PLC0415  (built and importable)

            return None
        return original()

    return compile_helpers


def _require_cpu_only() -> None:
    if torch.cuda.is_available():
        raise RuntimeError(
            "patch 'megatron_lm_cpu' is a CPU-only shim for Megatron-LM's training side and refuses "
            "to apply when torch.cuda.is_available(); on a GPU machine Megatron-LM runs unpatched."
        )


PATCH = Patch(
    name=NAME,
    supported=SUPPORTED,
    why=__doc__,
    precondition=_require_cpu_only,
    # batch_invariant_kernels exists from megatron-core 0.16 (0.15's training side never imports it)
    stand_ins=(StandIn(BATCH_INVARIANT_KERNELS, "triton", _batch_invariant_stand_in, releases=">=0.16"),),
    verify=check_checkout,
    targets=tuple(Target(m, "torch", make_torch_proxy(training=True)) for m in TORCH_PROXY_MODULES)
    + tuple(Target(m, "torch", make_torch_proxy(training=True), releases=r)
            for m, r in (TRAINING_UTILS, TRAINING_COMMON_UTILS))
    + (
        Target("megatron.training.training", "initialize_megatron", _make_allow_no_cuda),
        Target("megatron.training.training", "get_model", under_mode(_TensorCudaIsIdentity)),
        Target("megatron.training.initialize", "_warmup_jit_function", _make_noop),
        # megatron.legacy.fused_kernels is gone from core_v0.17 (nothing there compiles kernels)
        Target("megatron.legacy.fused_kernels", "load", _make_noop, releases="<0.17"),
        Target("megatron.core.datasets.utils", "compile_helpers", _make_compile_helpers),
    ),
)
