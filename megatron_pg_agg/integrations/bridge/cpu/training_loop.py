"""Megatron-Bridge's own training loop (``megatron.bridge.training.pretrain``) on CPU with gloo.

WHY
    Bridge's loop is Megatron-LM's ``pretrain()`` rewritten around a ``ConfigContainer``, and it
    assumes CUDA the same way: ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless
    asked not to (its ``allow_no_cuda`` argument, never passed by ``setup``); the data loaders, the
    set-up, the training loop and its statistics create ``device="cuda"`` tensors, read the current
    CUDA device, synchronise, empty the cache and read memory statistics; checkpoints save the CUDA
    RNG state; the megatron-core timers it uses do the same. The loop itself is plain PyTorch and
    megatron-core and runs on CPU once those spots see the CPU.

HOW (the ``megatron_lm_cpu`` patch's pieces, on Bridge's modules)
    * ``torch`` in each module of :data:`TORCH_PROXY_MODULES` is the training proxy of
      :mod:`megatron_pg_agg.patches.cpu.cpu_torch` (a CUDA ``device`` argument maps to the CPU, the
      current device is the CPU,
      ``synchronize``/``empty_cache``/``set_device`` are no-ops, streams are no-ops, memory
      statistics are zero, one device is seen, the CUDA RNG calls use the CPU generator);
    * ``initialize_megatron`` (as ``setup`` imported it) is called with ``allow_no_cuda=True``;
    * ``ModelProviderMixin.provide_distributed_model`` builds with ``use_cpu_initialization=True``
      (``setup`` never passes it, and ``get_model`` then moves each chunk to the CUDA device);
    * ``_warmup_jit_function`` (the CUDA JIT fusions' warm-up) is a no-op;
    * ``compile_helpers`` (imported by name into Bridge's ``initialize``) runs ``make`` in
      site-packages, which ships no makefile: skipped where the built helpers import.

    CPU-only: it refuses to apply when CUDA is available. With ``bridge_cpu`` for the import.

TARGETS (megatron-core 0.19, megatron-bridge 0.6.x)
    ``<module>.torch`` for :data:`TORCH_PROXY_MODULES`;
    ``megatron.bridge.training.setup.initialize_megatron``;
    ``megatron.bridge.models.model_provider.ModelProviderMixin.provide_distributed_model``;
    ``megatron.bridge.training.initialize.compile_helpers`` and ``._warmup_jit_function``.
"""
from __future__ import annotations

from megatron_pg_agg.integrations.bridge.cpu.lora_layers import stand_in
from megatron_pg_agg.patches._machinery import Target
from megatron_pg_agg.patches.cpu.cpu_torch import make_torch_proxy
from megatron_pg_agg.patches.cpu.megatron_lm_cpu import _make_allow_no_cuda, _make_compile_helpers, _make_noop

NAME = "bridge_loop_cpu"


def _make_cpu_initialization(original):
    def provide_distributed_model(self, *args, **kwargs):
        # get_model moves every chunk to torch.cuda.current_device() unless the weights are
        # initialised on the CPU, as the trainer builds them there (use_cpu_initialization=True)
        kwargs["use_cpu_initialization"] = True
        return original(self, *args, **kwargs)

    return provide_distributed_model

TORCH_PROXY_MODULES: tuple[str, ...] = (
    "megatron.bridge.training.initialize",  # device_count, set_device, the MoE aux-loss scale's device
    "megatron.bridge.training.setup",  # the start-time tensor
    "megatron.bridge.training.train",  # empty_cache, synchronize, exit flags
    "megatron.bridge.training.optim",  # empty_cache
    "megatron.bridge.training.checkpointing",  # the iteration tensor, the CUDA RNG state
    "megatron.bridge.training.utils.train_utils",  # grad-norm and loss buffers, memory statistics
    "megatron.bridge.data.loaders",  # the do-train/valid/test flags
    "megatron.bridge.models.model_provider",  # the current device of get_model
    "megatron.training.models.dist_utils",  # torch.cuda.Stream() around the DDP wrap (megatron-core 0.19's wheel)
    "megatron.core.timers",  # barrier timers: device='cuda' buffers
    "megatron.core.rerun_state_machine",  # CUDA RNG state around reruns
)


PATCH = stand_in(
    NAME, __doc__,
    *(Target(m, "torch", make_torch_proxy(training=True)) for m in TORCH_PROXY_MODULES),
    Target("megatron.bridge.training.setup", "initialize_megatron", _make_allow_no_cuda),
    Target("megatron.bridge.models.model_provider", "ModelProviderMixin.provide_distributed_model",
           _make_cpu_initialization),
    # imported by name into Bridge's initialize (the megatron_lm_cpu patch wraps the original)
    Target("megatron.bridge.training.initialize", "compile_helpers", _make_compile_helpers),
    # warms the CUDA JIT fusions up with torch.rand(device="cuda"): nothing to warm on CPU
    Target("megatron.bridge.training.initialize", "_warmup_jit_function", _make_noop),
)
