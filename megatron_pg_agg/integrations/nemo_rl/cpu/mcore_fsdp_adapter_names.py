"""megatron-core 0.19's FSDP adapter under the names NeMo-RL imports: ``FullyShardedDataParallelV1/V2``.

WHY
    ``nemo_rl/models/policy/workers/megatron_policy_worker.py:42-45`` (and the value worker,
    ``megatron_value_worker.py:37-40``) import ``FullyShardedDataParallelV1`` and
    ``FullyShardedDataParallelV2`` from ``megatron.core.distributed.fsdp.mcore_fsdp_adapter``. Those
    names arrive with the v1/v2 FSDP split on Megatron-LM main (14346b65, package 0.20.0 dev, the
    submodule NeMo-RL 7ea279a runs); the released megatron-core 0.19.2 has one class,
    ``FullyShardedDataParallel`` (the v1 wrapper), so the worker module fails to import with
    ``ImportError: cannot import name 'FullyShardedDataParallelV1'``. The worker uses both names in one
    place only: the ``isinstance`` check of ``move_model`` (``megatron_policy_worker.py:3218-3220``).

WHAT
    ``FullyShardedDataParallelV1`` is ``FullyShardedDataParallel`` (the v1 wrapper had that name before
    the split: the same fallback Megatron-Bridge's own ``fsdp_compat`` makes on main), and
    ``FullyShardedDataParallelV2`` is a class nothing is an instance of, which refuses to be built
    (FSDP v2 does not exist in 0.19).

HOW (no name is written into megatron-core's module)
    The adapter module's ``__class__`` becomes a subclass of ``types.ModuleType`` whose
    ``__getattr__`` answers the two names (module ``__class__`` assignment is the documented way to
    give a module attribute hooks; ``from ... import`` falls back to it). Every attribute the module
    has is unchanged; reverting restores ``types.ModuleType``. The target exists on 0.19 only
    (``Target.releases``); 0.20 defines the names itself.

    CPU-only, like the other NeMo-RL stand-ins (a GPU run uses NeMo-RL's own Megatron-LM submodule).

TARGETS (megatron-core 0.19)
    ``megatron.core.distributed.fsdp.mcore_fsdp_adapter.__class__``.
"""
from __future__ import annotations

import importlib

from megatron_pg_agg.integrations.nemo_rl.cpu._common import Target, stand_in

NAME = "nemo_rl_mcore_fsdp_adapter_names"
ADAPTER = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"
NAMES = ("FullyShardedDataParallelV1", "FullyShardedDataParallelV2")


class FullyShardedDataParallelV2Unavailable:
    """``FullyShardedDataParallelV2`` on megatron-core 0.19: no such wrapper; nothing is an instance."""

    def __new__(cls, *args, **kwargs):
        raise RuntimeError("FullyShardedDataParallelV2 (Megatron FSDP v2) does not exist in megatron-core 0.19; "
                           "stood in by the NeMo-RL CPU stand-in " + NAME)


def _make_module_class(original: type) -> type:
    def __getattr__(self, name: str):
        if name == "FullyShardedDataParallelV1":
            return importlib.import_module(ADAPTER).FullyShardedDataParallel
        if name == "FullyShardedDataParallelV2":
            return FullyShardedDataParallelV2Unavailable
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    return type("McoreFsdpAdapterWithV1V2Names", (original,), {"__getattr__": __getattr__, "__module__": __name__})


PATCH = stand_in(NAME, __doc__, Target(ADAPTER, "__class__", _make_module_class, releases="<0.20"))
