"""What use_pg_loss refuses in a Megatron-Bridge recipe (pg_recipe_problems reads the config only:
a namespace with the ConfigContainer's fields stands in for it), and the bridge_loop_cpu patch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_pg_agg.integrations.bridge.cpu import lora_layers, training_loop
from megatron_pg_agg.integrations.bridge.loop import pg_recipe_problems
from megatron_pg_agg.versions import in_range, installed_megatron_core_version
from tests.support.optional import REQUIRE_BRIDGE, require

ROOT = Path(__file__).resolve().parents[3]


def _recipe(**changes):
    cfg = SimpleNamespace(
        model=SimpleNamespace(calculate_per_token_loss=True, should_pad_vocab=False, mtp_num_layers=None,
                              bf16=False, fp16=False, softmax_type="vanilla", tensor_model_parallel_size=2,
                              experimental_attention_variant=None),
        train=SimpleNamespace(micro_batch_size=1),
        ddp=SimpleNamespace(average_in_collective=False, use_megatron_fsdp=False),
        validation=SimpleNamespace(eval_iters=0),
        dist=SimpleNamespace(distributed_backend="gloo", use_torch_fsdp2=False))
    for path, value in changes.items():
        owner, name = path.split("__")
        setattr(getattr(cfg, owner), name, value)
    return cfg


def test_a_pg_recipe_passes():
    assert pg_recipe_problems(_recipe()) == []


@pytest.mark.parametrize("changes,words", [
    ({"model__calculate_per_token_loss": False}, ["calculate_per_token_loss is False", "microbatch means"]),
    ({"train__micro_batch_size": 4}, ["micro_batch_size = 4", "packed THD row"]),
    ({"ddp__average_in_collective": True}, ["average_in_collective is True"]),
    ({"validation__eval_iters": 5}, ["eval_iters = 5"]),
    ({"model__should_pad_vocab": True}, ["should_pad_vocab", "probability mass"]),
    ({"model__mtp_num_layers": 1}, ["mtp_num_layers"]),
    ({"dist__distributed_backend": "nccl"}, ["'nccl' on a machine without CUDA"]),
    ({"model__bf16": True}, ["cfg.model.bf16 on CPU"]),
    # megatron-core's known silent bugs (Megatron-LM #7452), by finding
    ({"model__softmax_type": "learnable"},
     ["cfg.model.softmax_type learnable with cfg.model.tensor_model_parallel_size 2", "finding 8"]),
    ({"model__experimental_attention_variant": "gated_delta_net"},
     ["cfg.model.experimental_attention_variant gated_delta_net", "finding 11"]),
    ({"ddp__use_megatron_fsdp": True}, ["cfg.ddp.use_megatron_fsdp", "finding 12"]),
    ({"dist__use_torch_fsdp2": True}, ["cfg.dist.use_torch_fsdp2:", "scale_gradients", "W/(DP*CP) times too large"]),
])
def test_each_problem_is_named(changes, words):
    problems = pg_recipe_problems(_recipe(**changes))
    assert len(problems) == 1, problems
    for word in words:
        assert word in problems[0], (word, problems)


BRIDGE_RELEASE = (in_range(installed_megatron_core_version(), lora_layers.SUPPORTED)
                  and lora_layers.installed_bridge_version() is not None)

_APPLIED = """
import torch
from megatron_pg_agg.integrations.bridge.cpu import apply_bridge_cpu_patches
from megatron_pg_agg.patches import revert_megatron_patches
from megatron_pg_agg.patches._machinery import MARKER

assert apply_bridge_cpu_patches(loop=True) == [
    "cpu_gloo", "bridge_cpu", "bridge_loop_cpu"]
from megatron.bridge.training import initialize, setup
from megatron.bridge.models.model_provider import ModelProviderMixin

assert getattr(setup.initialize_megatron, MARKER) == "bridge_loop_cpu"
assert getattr(initialize.torch, MARKER) == "bridge_loop_cpu" and initialize.torch.cuda.device_count() == 1
assert getattr(ModelProviderMixin.__dict__["provide_distributed_model"], MARKER) == "bridge_loop_cpu"
revert_megatron_patches()
assert initialize.torch is torch
print("bridge_loop_cpu: applied and reverted")
"""


def test_the_model_is_built_on_the_cpu_whatever_the_caller_passes():
    calls = []
    wrapped = training_loop._make_cpu_initialization(lambda self, *a, **k: calls.append((self, a, k)))
    wrapped("provider", ddp_config="ddp", use_cpu_initialization=False)
    assert calls == [("provider", (), {"ddp_config": "ddp", "use_cpu_initialization": True})]


@pytest.mark.optional_stack
def test_the_loop_patch_applies_to_megatron_bridge_0_6():
    """In a fresh interpreter (megatron.bridge imports the megatron.training of megatron-core's wheel)."""
    require(None if BRIDGE_RELEASE else "megatron-bridge 0.6 with megatron-core 0.19 only (one of them is missing)",
            REQUIRE_BRIDGE)
    out = subprocess.run([sys.executable, "-c", _APPLIED], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and "applied and reverted" in out.stdout, out.stderr[-5000:]
    assert training_loop.NAME == "bridge_loop_cpu"
