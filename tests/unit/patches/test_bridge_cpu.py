"""The bridge_cpu patch: its stand-in alone (any release), and applied to the real megatron-bridge
0.6 on megatron-core 0.19 (there only; elsewhere it must refuse, naming the release)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pg_agg.patches._machinery import apply, is_applied
from megatron_pg_agg.patches.cpu import bridge_cpu
from megatron_pg_agg.versions import in_range, installed_megatron_core_version
from tests.support.optional import REQUIRE_BRIDGE, require

ROOT = Path(__file__).resolve().parents[3]
BRIDGE_RELEASE = (in_range(installed_megatron_core_version(), bridge_cpu.SUPPORTED)
                  and bridge_cpu.installed_bridge_version() is not None)


def test_the_lora_stand_in_defines_what_peft_imports_and_refuses_to_build():
    module = bridge_cpu._lora_layers_stand_in(bridge_cpu.LORA_LAYERS)
    for name in bridge_cpu.LORA_NAMES:
        cls = getattr(module, name)
        with pytest.raises(RuntimeError, match="LoRA through Megatron-Bridge needs Transformer Engine"):
            cls()
    resiliency = bridge_cpu._resiliency_stand_in(bridge_cpu.RESILIENCY_INPROCESS)
    with pytest.raises(RuntimeError, match="in-process restart needs nvidia-resiliency-ext"):
        resiliency.CallWrapper()
    assert bridge_cpu._resiliency_stand_in(bridge_cpu.RESILIENCY).__path__ == []  # a package


@pytest.mark.skipif(BRIDGE_RELEASE, reason="the refusal outside megatron-core 0.19 / without megatron-bridge")
def test_it_refuses_outside_its_releases():
    with pytest.raises(RuntimeError, match="nothing was patched|Nothing was patched"):
        apply(bridge_cpu.PATCH)
    assert not is_applied(bridge_cpu.PATCH)


_APPLIED_FOR_REAL = """
import sys
import torch
from megatron_pg_agg.patches.cpu import bridge_cpu
from megatron_pg_agg.patches._machinery import MARKER, apply, revert, stood_in

assert "transformer_engine" not in sys.modules  # the condition the stand-in is for
assert apply(bridge_cpu.PATCH)
assert stood_in(bridge_cpu.PATCH) == [bridge_cpu.LORA_LAYERS, bridge_cpu.RESILIENCY, bridge_cpu.RESILIENCY_INPROCESS]
assert getattr(sys.modules[bridge_cpu.LORA_LAYERS], MARKER) == bridge_cpu.NAME
from megatron.bridge import AutoBridge  # imports through the stand-in
from megatron.bridge.models.conversion import param_mapping

proxy = param_mapping.torch
assert getattr(proxy, MARKER) == bridge_cpu.NAME and str(proxy.cuda.current_device()) == "cpu"
assert proxy.zeros(2).sum().item() == 0  # everything else is the real torch
assert revert(bridge_cpu.PATCH)
assert param_mapping.torch is torch and bridge_cpu.LORA_LAYERS not in sys.modules
assert bridge_cpu.RESILIENCY not in sys.modules
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
