"""verl 0.9.1's Megatron engine on a CPU machine, for the tests: stand-ins for its CUDA-only parts.

verl has no CPU platform (it falls back to CUDA), selects engines by device, and accepts only
bf16/fp16 in ``McoreEngineConfig``. Here: a CPU platform registered through verl's own
``set_platform``; the engine looked up as on an NVIDIA GPU (``VERL_ENGINE_DEVICE`` /
``VERL_ENGINE_VENDOR``, verl's own override); fp32 set after the config's check (the checks are
in float32 against a float64 reference: bf16 would hide every error under its rounding); the
provider's layer spec and device settings passed as verl's ``override_transformer_config``
(megatron-core's local spec with the project's THD core attention, as ``--hf-model`` builds on
CPU). megatron-core and Megatron-Bridge get the project's CPU patches. Nothing of verl's engine,
worker, loss or data code is replaced.
"""
from __future__ import annotations

import contextlib
import os
import types

import torch


def cpu_platform():
    from verl.plugin.platform import PlatformBase

    module = types.SimpleNamespace(
        synchronize=lambda *a, **k: None, empty_cache=lambda: None, is_available=lambda: False,
        current_device=lambda: "cpu", set_device=lambda *a: None, manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed, memory_allocated=lambda *a: 0, memory_reserved=lambda *a: 0,
        max_memory_allocated=lambda *a: 0, max_memory_reserved=lambda *a: 0, mem_get_info=lambda *a: (0, 0),
        get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state, device_count=lambda: 1)

    class CpuPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = module

        def is_available(self): return True
        def current_device(self): return "cpu"
        def device_count(self): return 1
        def set_device(self, index): pass
        def synchronize(self, index=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, settings): pass
        def empty_cache(self): pass
        def get_device_capability(self, index=0): return (None, None)
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
        def cudart(self): return None
        def is_ipc_supported(self): return False
        def nvtx_range(self, msg): return contextlib.nullcontext()
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_noset_envvars(self): return []
        def ray_resource_name(self): return "CPU"

    return CpuPlatform()


def setup_cpu() -> None:
    """Before anything builds: the project's CPU patches, verl's CPU platform, the engine lookup."""
    from megatron_pg_agg.integrations.bridge.cpu import apply_bridge_cpu_patches

    apply_bridge_cpu_patches(loop=True)
    from verl.plugin.platform import set_platform

    set_platform(cpu_platform())
    os.environ["VERL_ENGINE_DEVICE"], os.environ["VERL_ENGINE_VENDOR"] = "cuda", "nvidia"


def build_engine(hf_path: str, *, per_token_loss: bool, remove_padding: bool = True,
                 model_type: str = "language_model"):
    """verl's own ``EngineRegistry.new(...)`` + ``initialize()`` (Megatron-Bridge builds the model
    from the HF folder and loads its weights; verl builds DDP, its optimizer and scheduler).
    ``model_type="value_model"``: verl's critic engine (``MegatronEngineWithValueHead``: the output
    layer replaced by verl's value head, hidden -> 1, left at its random initialisation)."""
    from megatron.core.transformer.enums import AttnBackend
    from verl.workers.config import HFModelConfig, McoreCheckpointConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine import EngineRegistry

    from megatron_pg_agg.integrations.bridge.hf_model import _layer_spec
    from megatron_pg_agg.megatron.model import device_settings

    overrides = {"transformer_layer_spec": _layer_spec, "attention_backend": AttnBackend.auto,
                 **device_settings(False), "calculate_per_token_loss": per_token_loss}
    model_config = HFModelConfig(path=hf_path, use_remove_padding=remove_padding)
    model_config.model_type = model_type
    engine_config = McoreEngineConfig(dtype="bfloat16", sequence_parallel=False, use_distributed_optimizer=False,
                                      override_transformer_config=overrides)
    object.__setattr__(engine_config, "dtype", "float32")  # after verl's bf16/fp16-only check (module docstring)
    engine_config.use_remove_padding = remove_padding
    optimizer = McoreOptimizerConfig(lr=1e-3, clip_grad=0.0, total_training_steps=10)
    engine = EngineRegistry.new(model_type=model_type, backend="megatron", model_config=model_config,
                                engine_config=engine_config, optimizer_config=optimizer,
                                checkpoint_config=McoreCheckpointConfig())
    engine.initialize()
    return engine
