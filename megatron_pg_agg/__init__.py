"""megatron_pg_agg: exact policy-gradient loss aggregation for Megatron-core RL training.

The aggregation contract (formulas for every mode) is in :mod:`megatron_pg_agg.core.aggregation`.

Subpackages, lowest layer first (each imports only those before it; docs/development.md's code map):
``core`` (modes, the aggregation contract, the policy losses, no megatron-core), ``data`` (rollouts,
rollout files, the step planner), ``patches`` (the top-level ``patches/`` folder: Megatron's runtime
patches, the machinery, and in ``patches.cpu`` the stand-ins the trainer and the Megatron-LM entries
need on CPU), ``megatron`` (the megatron-core side: loss function, step runner, models), ``training``
(the trainer and the Megatron-LM entries), ``integrations`` (one folder per host: ``areal``, ``verl``,
``slime``, ``nemo_rl``, ``bridge``). Beside them: ``online`` (online GRPO, the main job without
rollouts) and ``parity`` (the layout parity command).
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
