"""megatron_pg_agg: exact policy-gradient loss aggregation for Megatron-core RL training.

The aggregation contract (formulas for every mode) is in :mod:`megatron_pg_agg.core.aggregation`.
"""
from .core.aggregation import TokenWeights, aggregate, token_weights, weighted_sum
from .core.losses import PGLossConfig
from .core.modes import ALIASES, MODES, REFUSED_ALIASES, resolve_mode
from .training.args import add_pg_agg_args, config_from_args
from .versions import PACKAGE_VERSION

__version__ = PACKAGE_VERSION
"""This package's version (written once, in :mod:`megatron_pg_agg.versions`)."""

__all__ = [
    "ALIASES",
    "MODES",
    "PGLossConfig",
    "REFUSED_ALIASES",
    "add_pg_agg_args",
    "config_from_args",
    "TokenWeights",
    "aggregate",
    "resolve_mode",
    "token_weights",
    "weighted_sum",
]
