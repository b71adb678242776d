"""Aggregation mode names: the four canonical modes and peers' names for them, resolved here only.

The contract (what each mode optimises) is documented once, in :mod:`megatron_pg_agg.core.aggregation`.

A peer's name sets the aggregation only. Where a peer's name also fixes the per-token loss (TRL's
``cispo``, ``luspo``, ``sapo``, ``vespo``), that part is chosen separately here
(``PGLossConfig.policy_loss`` / ``--pg-policy-loss``): :attr:`Alias.policy_loss` names the one to
pair with, and :attr:`Alias.note` says when there is none. A peer's name whose aggregation no mode
can express is refused (:data:`REFUSED_ALIASES`) with the reason and the closest explicit choice.
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
    """Where the peer's semantics differ from ours (empty when they match exactly). It is the
    docs/peer-aliases.md table's "differences" cell, word for word (``tests/unit/core/test_modes.py`` checks it)."""
    policy_loss: Optional[str] = None
    """The ``--pg-policy-loss`` to pair with, where the peer's name also fixes the token loss."""
    divisor_hint: str = ""
    """What the peer calls ``L`` (said when a required divisor is missing)."""


@dataclass(frozen=True)
class RefusedAlias:
    """A peer's name whose aggregation no mode here can express: refused, never approximated."""

    source: str
    why: str
    """Why it cannot be mapped."""
    closest: str
    """The closest explicit choice, and how it differs."""

    @property
    def note(self) -> str:
        """The docs/peer-aliases.md table's "differences" cell."""
        return f"{self.why}. Closest explicit choice: {self.closest}"

    def error(self, name: str) -> ValueError:
        return ValueError(
            f"mode={name!r} ({self.source}) cannot be mapped to an aggregation mode here: "
            f"{self.why}. Closest explicit choice: {self.closest}."
        )


# What the peers do (read from their source; docs/peer-aliases.md lists the files):
# - verl agg_loss: token-mean = sum / batch_num_tokens (mini-batch, all DP ranks); seq-mean-* divide
#   the sum over non-empty rows by global_batch_size = ppo_mini_batch_size * rollout.n, i.e. by
#   EVERY row of the mini-batch; seq-mean-token-sum-norm further divides by loss_scale_factor
#   (default loss_mask.shape[-1]); token-sum = masked sum * dp_size (no normaliser).
# - TRL GRPOTrainer._compute_loss: grpo/sapo = per-device mean over rows of row token means (empty
#   rows count, as 0); bnpo = per-device-micro-batch token mean; dr_grpo = sum / (rows *
#   max_completion_length); dapo/cispo/vespo = sum / num_items_in_batch (completion tokens of the
#   generation batch, all processes); luspo = mean over rows of (sequence loss * row length).
#   Per-micro-batch results are divided by the accumulation steps and averaged over processes.
_ROWS_VERL = (
    "verl divides by every row of the mini-batch (`global_batch_size` = `ppo_mini_batch_size` x "
    "`rollout.n`, empty responses included), ours by active responses: verl's J = ours x "
    "active / rows, equal when no response is empty"
)
_ROWS_TRL = (
    "TRL divides by every completion of the step (per device batch, then averaged over equal-size "
    "device batches and accumulation steps: one mean), empty ones included, ours by active "
    "responses: TRL's J = ours x active / completions, equal when no completion is empty"
)
_GENERATION_BATCH = (
    "TRL divides by `num_items_in_batch`, the completion tokens of the generation batch over all "
    "processes, counted before `mask_truncated_completions` and tool masks remove tokens (pass "
    "that mask as `denominator_mask`); a generation batch is one optimizer step at TRL's default "
    "`steps_per_generation` = `gradient_accumulation_steps`, otherwise each step is divided by "
    "the whole generation batch's tokens"
)

#: Peers' names. The alias table of docs/peer-aliases.md is written from this dict and REFUSED_ALIASES.
ALIASES: dict[str, Alias] = {
    # verl (actor.loss_agg_mode)
    "token-mean": Alias(TOKEN_MEAN, source="verl"),
    "seq-mean-token-mean": Alias(SEQ_MEAN, source="verl", note=_ROWS_VERL),
    "seq-mean-token-sum": Alias(CONSTANT, divisor=1.0, source="verl", note=_ROWS_VERL),
    "seq-mean-token-sum-norm": Alias(
        CONSTANT, divisor_required=True, source="verl",
        divisor_hint="verl's loss_scale_factor, e.g. the maximum response length",
        note="L is verl's `loss_scale_factor` (when unset, verl uses the padded response width "
        "`loss_mask.shape[-1]`; here L is always explicit); " + _ROWS_VERL,
    ),
    # TRL (GRPOConfig.loss_type)
    "grpo": Alias(SEQ_MEAN, source="TRL", note=_ROWS_TRL),
    "bnpo": Alias(
        TOKEN_MEAN, source="TRL",
        note="TRL takes one token mean per device micro-batch, then the plain mean of those over "
        "devices and accumulation steps; ours is one token mean over the step: equal when every "
        "micro-batch holds the same number of valid tokens",
    ),
    "dr_grpo": Alias(
        CONSTANT, divisor_required=True, source="TRL",
        divisor_hint="TRL's max_completion_length",
        note="L is TRL's `max_completion_length`; " + _ROWS_TRL,
    ),
    "dapo": Alias(TOKEN_MEAN, source="TRL", note="none at TRL's default: " + _GENERATION_BATCH),
    "cispo": Alias(
        TOKEN_MEAN, source="TRL", policy_loss="cispo",
        note="aggregation as `dapo` (same normaliser); token loss: pair with `--pg-policy-loss "
        "cispo`, which clamps the IS weight to [1 - eps_low, 1 + eps_high] where TRL only caps it "
        "at `epsilon_high` itself: set `--pg-clip-eps-high` to TRL's `epsilon_high` - 1 (the lower "
        "clamp has no TRL counterpart)",
    ),
    "sapo": Alias(
        SEQ_MEAN, source="TRL",
        note="aggregation only: SAPO's token loss (a temperature-controlled sigmoid gate instead of "
        "PPO's clip) has no `--pg-policy-loss` here; aggregation as `grpo`: " + _ROWS_TRL,
    ),
    "luspo": Alias(
        CONSTANT, divisor=1.0, source="TRL", policy_loss="gspo",
        note="token loss: pair with `--pg-policy-loss gspo` (TRL needs "
        "`importance_sampling_level=\"sequence\"`): TRL's sequence loss times the completion "
        "length is that completion's token sum; " + _ROWS_TRL,
    ),
    "vespo": Alias(
        TOKEN_MEAN, source="TRL",
        note="aggregation only: VESPO's token loss (a detached gamma weight of the sequence IS "
        "ratio times A log p) has no `--pg-policy-loss` here; aggregation as `dapo` (same "
        "normaliser)",
    ),
}

#: Peers' names that are refused, with the reason and the closest explicit choice.
REFUSED_ALIASES: dict[str, RefusedAlias] = {
    "token-sum": RefusedAlias(
        source="verl",
        why="verl's `token-sum` is the plain sum of the token losses of the mini-batch (`masked_sum "
        "x dp_size`, no normaliser), so the objective and its gradient grow with the tokens in the "
        "step; every mode here divides by a count of the step, and `constant`'s fixed L cannot "
        "cancel the active-response count, which changes from step to step",
        closest="mode='constant', divisor=1 (each response's token sum, averaged over active "
        "responses: token-sum / active responses), or mode='token_mean' (token-sum / valid tokens)",
    ),
}


def mode_choices() -> list[str]:
    """Every spelling the flag parser admits: canonical names first, then aliases, then refused
    peers' names (admitted so that :func:`resolve_mode` can say why it refuses them)."""
    return list(MODES) + list(ALIASES) + list(REFUSED_ALIASES)


def resolve_mode(mode: str, divisor: Optional[float] = None) -> tuple[str, Optional[float]]:
    """Return ``(canonical_mode, divisor)`` or raise a ValueError that says how to fix the call.

    Rules: ``constant`` needs a positive finite divisor; every other mode refuses one (a divisor
    that would be silently ignored is a configuration bug). A refused peer's name raises with the
    reason and the closest explicit choice.
    """
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a string, one of {mode_choices()}; got {type(mode).__name__}")
    canonical = mode
    hint = ""
    if mode in REFUSED_ALIASES:
        raise REFUSED_ALIASES[mode].error(mode)
    if mode in ALIASES:
        alias = ALIASES[mode]
        canonical = alias.mode
        hint = f" ({alias.divisor_hint})" if alias.divisor_hint else ""
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
                f"mode={mode!r} needs divisor=L{hint}, a positive finite number (e.g. the maximum "
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
