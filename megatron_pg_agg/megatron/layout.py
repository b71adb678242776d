"""The parallel layout type. It imports nothing of megatron, so run configs and test cases can
build one before megatron-core is loaded."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ParallelSizes:
    """The parallel layout of a run, the one type every entry, worker and the parity suite pass to
    :func:`init_parallel`: tensor, pipeline, virtual pipeline, context and data-parallel sizes."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (the interleaved schedule); None: not interleaved."""
    cp: int = 1
    """Context-parallel size."""
    dp: Optional[int] = None
    """Data-parallel size (without CP); None: what the world size leaves (:func:`init_parallel`
    returns the layout with it filled in)."""

    def config_kwargs(self) -> dict:
        """The parallel sizes as ``TransformerConfig`` keyword arguments."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp,
            context_parallel_size=self.cp,
        )

    def __str__(self) -> str:
        v = f"(vpp={self.vpp})" if self.vpp else ""
        return f"TP{self.tp}xPP{self.pp}{v}xCP{self.cp}xDP{self.dp}"
