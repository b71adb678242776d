"""AReaL's ``dtype`` reaches the model mbridge builds (float32 on CPU).

WHY
    ``MegatronEngine._build_hf_mcore_bridge`` (areal 1.0.4) makes the bridge with
    ``mbridge.AutoBridge.from_pretrained(path)``, whose ``Bridge.__init__`` builds the
    ``TransformerConfig`` at once with mbridge's default dtype (bf16), and only then sets
    ``bridge.dtype = <the engine's dtype>``. mbridge rebuilds its config from ``bridge.dtype`` only
    in ``set_extra_args``, which AReaL calls only with gradient checkpointing on. So
    ``actor.dtype="float32"`` is ignored: ``make_hf_and_mcore_config`` hands back the bf16 config,
    and the model, its ``Float16Module`` wrapper and the optimizer are bf16. A CPU check of the
    loss aggregation in float32 (and any float32 run) needs the engine's dtype honoured.

HOW (a wrapper, never a copy)
    ``make_hf_and_mcore_config`` as ``areal.engine.megatron_engine`` imported it: for an mbridge
    bridge whose config's ``params_dtype`` differs from the ``dtype`` AReaL passes (the bridge's own
    ``dtype`` by then), the bridge's config is rebuilt first with mbridge's own ``_build_config()``
    (what ``set_extra_args`` does); then the original runs and returns it. Nothing changes when
    the dtypes agree (bf16, AReaL's default).

    Applied with the other AReaL CPU patches (CPU-only, areal 1.0.4, mbridge 0.15.x:
    :func:`.megatron_engine.require_areal_on_cpu`), although the gap is there on a GPU too.

TARGETS (megatron-core 0.17, areal 1.0.4, mbridge 0.15.1)
    ``areal.engine.megatron_engine.make_hf_and_mcore_config``.
"""
from __future__ import annotations

import inspect

from megatron_pg_agg.integrations.areal.cpu.megatron_engine import ENGINE, stand_in
from megatron_pg_agg.patches._machinery import Target

NAME = "areal_mbridge_dtype"


def _make_config(original):
    signature = inspect.signature(original)

    def make_hf_and_mcore_config(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        bridge, dtype = bound.arguments["bridge"], bound.arguments["dtype"]
        if (bridge is not None and bound.arguments["bridge_type"] == "mbridge"
                and bridge.config.params_dtype != dtype):
            bridge.dtype = dtype
            bridge.config = bridge._build_config()
        return original(*bound.args, **bound.kwargs)

    return make_hf_and_mcore_config


PATCH = stand_in(NAME, __doc__, Target(ENGINE, "make_hf_and_mcore_config", _make_config))
