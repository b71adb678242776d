"""The bridge_cpu patch: its stand-in alone (any release), and applied to the real megatron-bridge
0.6 on megatron-core 0.19 (there only; elsewhere it must refuse, naming the release)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pg_agg.integrations.bridge.cpu import lora_layers
from megatron_pg_agg.patches._machinery import apply, is_applied
from megatron_pg_agg.versions import in_range, installed_megatron_core_version
from tests.support.optional import REQUIRE_BRIDGE, require

ROOT = Path(__file__).resolve().parents[3]
BRIDGE_RELEASE = (in_range(installed_megatron_core_version(), lora_layers.SUPPORTED)
                  and lora_layers.installed_bridge_version() is not None)


def test_the_lora_stand_in_defines_what_peft_imports_and_refuses_to_build():
    module = lora_layers._lora_layers_stand_in(lora_layers.LORA_LAYERS)
    for name in lora_layers.LORA_NAMES:
        cls = getattr(module, name)
        with pytest.raises(RuntimeError, match="LoRA through Megatron-Bridge needs Transformer Engine"):
            cls()
    resiliency = lora_layers._resiliency_stand_in(lora_layers.RESILIENCY_INPROCESS)
    with pytest.raises(RuntimeError, match="in-process restart needs nvidia-resiliency-ext"):
        resiliency.CallWrapper()
    assert lora_layers._resiliency_stand_in(lora_layers.RESILIENCY).__path__ == []  # a package


@pytest.mark.skipif(BRIDGE_RELEASE, reason="the refusal outside megatron-core 0.19 / without megatron-bridge")
def test_it_refuses_outside_its_releases():
    with pytest.raises(RuntimeError, match="nothing was patched|Nothing was patched"):
        apply(lora_layers.PATCH)
    assert not is_applied(lora_layers.PATCH)


_APPLIED_FOR_REAL = """
import sys
import torch
from megatron_pg_agg.integrations.bridge.cpu import lora_layers
from megatron_pg_agg.patches._machinery import MARKER, apply, revert, stood_in

assert "transformer_engine" not in sys.modules  # the condition the stand-in is for
assert apply(lora_layers.PATCH)
assert stood_in(lora_layers.PATCH) == [lora_layers.LORA_LAYERS, lora_layers.RESILIENCY,
                                      lora_layers.RESILIENCY_INPROCESS]
assert getattr(sys.modules[lora_layers.LORA_LAYERS], MARKER) == lora_layers.NAME
from megatron.bridge import AutoBridge  # imports through the stand-in
from megatron.bridge.models.conversion import param_mapping

proxy = param_mapping.torch
assert getattr(proxy, MARKER) == lora_layers.NAME and str(proxy.cuda.current_device()) == "cpu"
assert proxy.zeros(2).sum().item() == 0  # everything else is the real torch
assert revert(lora_layers.PATCH)
assert param_mapping.torch is torch and lora_layers.LORA_LAYERS not in sys.modules
assert lora_layers.RESILIENCY not in sys.modules
print("bridge_cpu: applied and reverted")
"""


@pytest.mark.optional_stack
def test_it_runs_on_megatron_bridge_0_6_with_megatron_core_0_19():
    """In a fresh interpreter: importing megatron.bridge also imports the megatron.training that
    megatron-core 0.19's wheel ships, which would shadow a Megatron-LM checkout in later tests."""
    require(None if BRIDGE_RELEASE else "megatron-bridge 0.6 with megatron-core 0.19 only (one of them is missing)",
            REQUIRE_BRIDGE)
    out = subprocess.run([sys.executable, "-c", _APPLIED_FOR_REAL], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0 and "applied and reverted" in out.stdout, out.stderr[-5000:]
