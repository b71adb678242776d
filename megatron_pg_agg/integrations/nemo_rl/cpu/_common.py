"""What every NeMo-RL CPU stand-in shares: the CPU-only refusal, the NeMo-RL release check, the
release ranges they were written against, and :func:`stand_in`, which builds each one's ``PATCH``
from them."""
from __future__ import annotations

import importlib
import sys

import torch

from megatron_pg_agg.patches._machinery import Target, patch_family  # noqa: F401  (Target re-exported for the stand-ins)
from megatron_pg_agg.patches.cpu import cpu_torch  # noqa: F401

SUPPORTED_MEGATRON_CORE = ">=0.19,<0.20"
"""megatron-core releases the stand-ins were written against (0.19.2 tested; NeMo-RL 7ea279a itself
runs Megatron-LM 14346b65, package 0.20.0 dev, through Megatron-Bridge's submodule)."""
SUPPORTED_NEMO_RL = ">=0.6.0,<0.7"
"""NeMo-RL releases (``nemo_rl.__version__``) the stand-ins were written against (0.6.0 @ 7ea279a)."""


def require_cpu(name: str):
    """A ``Patch.precondition``: refuse on a machine where CUDA is available."""

    def precondition() -> None:
        if torch.cuda.is_available():
            raise RuntimeError(
                f"patch {name!r} is a CPU-only stand-in for NeMo-RL's Megatron path and refuses to apply when "
                f"torch.cuda.is_available(); on a GPU NeMo-RL runs unpatched.")

    return precondition


def require_nemo_rl(name: str):
    """A ``Patch.verify``: NeMo-RL (a user's checkout on sys.path, not a distribution) in range."""

    def verify() -> None:
        from packaging.specifiers import SpecifierSet  # noqa: PLC0415
        from packaging.version import Version  # noqa: PLC0415

        nemo_rl = sys.modules.get("nemo_rl") or importlib.import_module("nemo_rl")
        version = getattr(nemo_rl, "__version__", "0")
        if Version(version) not in SpecifierSet(SUPPORTED_NEMO_RL):
            raise RuntimeError(f"patch {name!r} supports NeMo-RL {SUPPORTED_NEMO_RL!r}, but the nemo_rl on sys.path "
                               f"({nemo_rl.__file__}) is {version}; nothing was patched.")

    return verify


stand_in = patch_family(supported=SUPPORTED_MEGATRON_CORE, refusal=require_cpu, verify=require_nemo_rl)
"""A NeMo-RL CPU stand-in's ``Patch``: ``targets`` under the megatron-core range
:data:`SUPPORTED_MEGATRON_CORE`, refused where CUDA is available (a ``precondition`` given to it must
call ``require_cpu(name)`` itself) and where the NeMo-RL on ``sys.path`` is out of range."""
