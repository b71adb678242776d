"""The objective a host's plug-in trains: one type for every host (AReaL, NeMo-RL, slime), shared by
their plug-ins like :mod:`.step_weights`.

An objective is a mode and, for ``constant``, its divisor ``L``. Over each optimizer step of the host
the plug-in makes the host's own loss back-propagate

    J = (1 / W) * sum_t c_t * pg_t

with ``c_t`` and ``W`` the :func:`~megatron_pg_agg.core.aggregation.token_weights` of the mode over
the step (the contract, and the filtered-numerator rule, are written once in
:mod:`megatron_pg_agg.core.aggregation`; peers' mode names resolve in :mod:`megatron_pg_agg.core.modes`).

Each host reads the objective from its own keys and refuses in its own words, through
:func:`refused_as` around the construction:

* slime: ``pg_agg_mode``, ``pg_agg_divisor`` (its ``--custom-config-path`` YAML), ``SlimeConfigError``;
* NeMo-RL: ``loss_fn.pg_agg.mode``, ``loss_fn.pg_agg.divisor``, ``NemoRLConfigError``;
* AReaL: ``MEGATRON_PG_AGG_AREAL=<mode>[:<L>]`` or ``use_pg_agg(config, mode, divisor)``,
  ``ArealConfigError``.

What only one host offers stays in that host's settings, beside this type: AReaL's group baseline and
value mode, NeMo-RL's filtered-numerator threshold.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from megatron_pg_agg.core.modes import resolve_mode

__all__ = ["HostObjective", "refused_as"]


@dataclass(frozen=True)
class HostObjective:
    """What a host's plug-in trains (module docstring). Validated on construction, on the host before
    any step: a mode or divisor refused raises :func:`~megatron_pg_agg.core.modes.resolve_mode`'s
    ``ValueError`` (``TypeError`` for a value of the wrong type), which says how to fix it."""

    mode: str
    """token_mean, seq_mean, prompt_mean or constant. A peer's name (verl's ``seq-mean-token-sum``,
    TRL's ``dr_grpo``, ...) is accepted and resolved to one of these on construction."""
    divisor: Optional[float] = None
    """constant's ``L``, a positive finite number (a float after construction; an alias that fixes it,
    such as ``seq-mean-token-sum``, fills it in); None for every other mode."""

    def __post_init__(self) -> None:
        mode, divisor = resolve_mode(self.mode, self.divisor)
        # frozen: the canonical names replace the host's spelling, so objectives compare by meaning
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "divisor", divisor)


@contextmanager
def refused_as(error: type, read: Optional[str]) -> Iterator[None]:
    """Within: a ``TypeError`` or ``ValueError`` (a refusal of :class:`HostObjective` or of the host's own
    settings) is raised again as the host's ``error`` class, ``"<read>: <reason>"``. ``read``: what
    the host read, in its own keys (``pg_agg_mode='constant', pg_agg_divisor=None``); None where the
    caller passed the values as arguments, which the reason already names."""
    try:
        yield
    except (TypeError, ValueError) as reason:
        raise error(str(reason) if read is None else f"{read}: {reason}") from reason
