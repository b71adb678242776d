"""megatron_pg_agg: exact policy-gradient loss aggregation for Megatron-core RL training.

The aggregation contract (formulas for every mode) is in :mod:`megatron_pg_agg.aggregation`.
"""
from .aggregation import TokenWeights, aggregate, token_weights, weighted_sum
from .modes import ALIASES, MODES, resolve_mode

__version__ = "0.1.0"

__all__ = [
    "ALIASES",
    "MODES",
    "TokenWeights",
    "aggregate",
    "resolve_mode",
    "token_weights",
    "weighted_sum",
]
