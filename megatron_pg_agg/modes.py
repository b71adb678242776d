"""Aggregation mode names: the four canonical modes and peers' names for them, resolved here only.

The contract (what each mode optimises) is documented once, in :mod:`megatron_pg_agg.aggregation`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

TOKEN_MEAN = "token_mean"
SEQ_MEAN = "seq_mean"
PROMPT_MEAN = "prompt_mean"
CONSTANT = "constant"

#: The canonical mode names, default first.
MODES = (TOKEN_MEAN, SEQ_MEAN, PROMPT_MEAN, CONSTANT)


@dataclass(frozen=True)
class Alias:
    """A peer framework's name for one of our modes."""

    mode: str
    """The canonical mode it resolves to."""
    divisor: Optional[float] = None
    """A divisor the alias implies (verl's ``seq-mean-token-sum`` is ``constant`` with 1)."""
    divisor_required: bool = False
    """True when the alias means ``constant`` and the user must supply the divisor."""
    source: str = ""
    """Which framework uses the name."""
    note: str = ""
    """Where the peer's semantics differ from ours (empty when they match exactly)."""


#: Peers' names. The README's alias table is written from this dict.
ALIASES: dict[str, Alias] = {
    "token-mean": Alias(TOKEN_MEAN, source="verl"),
    "seq-mean-token-mean": Alias(
        SEQ_MEAN,
        source="verl",
        note="older verl releases average over every row, empty responses included",
    ),
    "seq-mean-token-sum": Alias(
        CONSTANT,
        divisor=1.0,
        source="verl",
        note="ours averages the per-response sums over active responses only",
    ),
    "seq-mean-token-sum-norm": Alias(
        CONSTANT,
        divisor_required=True,
        source="verl",
        note="verl divides the batch sum by the horizon only; ours also divides by the active "
        "response count (Dr. GRPO's 1/G), a per-step factor",
    ),
    "dapo": Alias(TOKEN_MEAN, source="TRL", note=""),
    "grpo": Alias(
        SEQ_MEAN,
        source="TRL",
        note="TRL averages per device batch and counts empty completions as zero-loss rows; "
        "ours is one mean over all active responses of the step",
    ),
    "dr_grpo": Alias(
        CONSTANT,
        divisor_required=True,
        source="TRL",
        note="TRL divides by every completion of the device batch (empty ones included) times "
        "max_completion_length; ours by active responses of the step times the divisor",
    ),
}


def mode_choices() -> list[str]:
    """Every accepted spelling: canonical names first, then aliases."""
    return list(MODES) + list(ALIASES)


def resolve_mode(mode: str, divisor: Optional[float] = None) -> tuple[str, Optional[float]]:
    """Return ``(canonical_mode, divisor)`` or raise a ValueError that says how to fix the call.

    Rules: ``constant`` needs a positive finite divisor; every other mode refuses one (a divisor
    that would be silently ignored is a configuration bug).
    """
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a string, one of {mode_choices()}; got {type(mode).__name__}")
    canonical = mode
    if mode in ALIASES:
        alias = ALIASES[mode]
        canonical = alias.mode
        if alias.divisor is not None:
            if divisor is not None and float(divisor) != alias.divisor:
                raise ValueError(
                    f"mode={mode!r} means constant with divisor={alias.divisor}; got "
                    f"divisor={divisor}. Use mode='constant' to choose another divisor."
                )
            divisor = alias.divisor
    elif mode not in MODES:
        raise ValueError(
            f"unknown mode={mode!r}: use one of {list(MODES)} (aliases: {list(ALIASES)})"
        )
    if canonical == CONSTANT:
        if divisor is None:
            raise ValueError(
                f"mode={mode!r} needs divisor=L, a positive finite number (e.g. the maximum "
                "response length): J = sum of masked token losses / (active sequences * L)"
            )
        if isinstance(divisor, bool) or not isinstance(divisor, (int, float)):
            raise TypeError(f"divisor must be a positive finite number; got {type(divisor).__name__}")
        if not (math.isfinite(divisor) and divisor > 0):
            raise ValueError(f"divisor must be a positive finite number; got divisor={divisor}")
        return canonical, float(divisor)
    if divisor is not None:
        raise ValueError(
            f"divisor={divisor} is only used by mode='constant'; drop it or use mode='constant' "
            f"(got mode={mode!r})"
        )
    return canonical, None
