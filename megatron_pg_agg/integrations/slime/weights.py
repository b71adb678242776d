"""slime's names for the shared per-sample denominators (:mod:`megatron_pg_agg.integrations.slime_family.weights`).

slime divides every step by ``--global-batch-size`` (``gbs``): ``D_i = W / (gbs * c_i)``.
"""
from __future__ import annotations

from typing import Hashable, Optional, Sequence

from megatron_pg_agg.integrations.objective import HostObjective
from megatron_pg_agg.integrations.slime_family import weights as shared
from megatron_pg_agg.integrations.slime_family.weights import SlimeFamilyConfigError

__all__ = ["SLIME", "SlimeConfigError", "step_denominators"]


class SlimeConfigError(SlimeFamilyConfigError):
    """A slime configuration or rollout the plug-in refuses (names the flags or the samples)."""


SLIME = shared.HostTerms("slime", SlimeConfigError, "gbs", "--global-batch-size")
"""slime in the shared refusals."""


def step_denominators(denominator_masks: Sequence[Sequence[int]], numerator_masks: Sequence[Sequence[int]],
                      steps: Sequence[Sequence[int]], group_ids: Optional[Sequence[Hashable]], *,
                      global_batch_size: int, objective: HostObjective,
                      names: Optional[Sequence[str]] = None) -> list[float]:
    """:func:`~megatron_pg_agg.integrations.slime_family.weights.step_denominators` with slime's
    step divisor, ``--global-batch-size`` for every step."""
    return shared.step_denominators(denominator_masks, numerator_masks, steps, group_ids,
                                    step_sizes=[global_batch_size] * len(steps), objective=objective, host=SLIME,
                                    names=names)
