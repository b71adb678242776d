"""mbridge 0.15.1 against AReaL 1.0.4's other pins: megatron-core 0.17 and transformers 5.

WHY
    AReaL 1.0.4 pins mbridge 0.15.1, megatron-core 0.17.0 and transformers 5.0-5.3, and the three
    do not fit together (device-independent; found running AReaL's engine on CPU):

    * ``mbridge.core.util.get_model`` compares the model type with
      ``ModelType.encoder_and_decoder`` in both of its build branches; megatron-core 0.17 removed
      that member (its ``ModelType`` has ``encoder_or_decoder`` only), so every model build fails
      with ``AttributeError``.
    * transformers 5 moved ``rope_theta`` into ``config.rope_parameters``; mbridge reads
      ``hf_config.rope_theta`` (``LLMBridge._get_gptmodel_args`` and each model's own), which
      transformers 5.3's configs no longer have.

HOW (a namespace proxy and a wrapper; nothing of mbridge is copied)
    * ``ModelType`` in ``mbridge.core.util``'s namespace is a proxy of megatron-core's enum that
      also has ``encoder_and_decoder``, a sentinel equal to nothing: the comparisons are False, as
      they were for every decoder-only model on the releases that had the member. The enum itself
      is not changed.
    * ``Bridge.__init__``: before the original runs, an HF config without ``rope_theta`` whose
      ``rope_parameters`` has one gets it as the attribute mbridge reads (the value transformers 4
      kept there). A config that has the attribute is left alone.

    Applied with the other AReaL CPU patches (CPU-only, areal 1.0.4, mbridge 0.15.x:
    :func:`.megatron_engine.require_areal_on_cpu`), although both gaps are there on a GPU too.

TARGETS (megatron-core 0.17, mbridge 0.15.1)
    ``mbridge.core.util.ModelType``; ``mbridge.core.bridge.Bridge.__init__``.
"""
from __future__ import annotations

import inspect
from typing import Any

from megatron_pg_agg.integrations.areal.cpu.megatron_engine import stand_in
from megatron_pg_agg.patches._machinery import Target
from megatron_pg_agg.patches.cpu.cpu_torch import _Proxy

NAME = "mbridge_pins"


class _ModelTypeWithEncoderAndDecoder(_Proxy):
    """megatron-core's ``ModelType`` as mbridge's ``util`` sees it: plus a never-equal member."""

    def __init__(self, real: Any) -> None:
        super().__init__(real)
        if not hasattr(real, "encoder_and_decoder"):
            self.encoder_and_decoder = object()


def _make_model_type(original):
    return _ModelTypeWithEncoderAndDecoder(original)


def _make_bridge_init(original):
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        hf_config = signature.bind(self, *args, **kwargs).arguments["hf_config"]
        rope = getattr(hf_config, "rope_parameters", None)
        if not hasattr(hf_config, "rope_theta") and isinstance(rope, dict) and "rope_theta" in rope:
            hf_config.rope_theta = rope["rope_theta"]
        return original(self, *args, **kwargs)

    return __init__


PATCH = stand_in(NAME, __doc__,
                 Target("mbridge.core.util", "ModelType", _make_model_type),
                 Target("mbridge.core.bridge", "Bridge.__init__", _make_bridge_init))
