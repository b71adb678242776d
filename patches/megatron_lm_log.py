"""Observe Megatron-LM's per-iteration training log: the one place that sees every step's
reduced loss report, grad norm and learning rate together.

WHY
    Megatron-LM's ``training_log`` prints a loss-report key only while its running value is > 0,
    so a policy-gradient objective (negative whenever the policy improves) vanishes from the
    console, and nothing outside the loop sees the step's reduced report. ``train()`` looks
    ``training_log`` up in its module globals once per iteration, on every rank, after
    ``train_step`` (which has reduced each ``[sum, count]`` report pair over microbatches and
    DP x CP) and the optimizer step: wrapping it is the narrowest hook Megatron-LM offers. The
    wrapper calls the original first, unchanged, then every registered observer.

HOW
    ``megatron.training.training.training_log`` is wrapped; :func:`add_observer` registers
    ``fn(TrainingLogEvent)``, :func:`remove_observer` drops it. Observers run on every rank (a
    collective inside one is allowed: every rank calls ``training_log`` each iteration).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

from ..versions import SUPPORTED_MEGATRON_CORE
from ._machinery import Patch, Target
from ._megatron_lm_release import check_checkout

NAME = "megatron_lm_log"
SUPPORTED = SUPPORTED_MEGATRON_CORE


@dataclass(frozen=True)
class TrainingLogEvent:
    """What ``training_log`` received for one iteration."""

    iteration: int
    """Iterations completed (1 after the first step)."""
    loss_dict: dict
    """The step's reduced report (``sum / count`` per key); empty off the last pipeline stage."""
    learning_rate: Optional[float]
    skipped_iter: int
    """1 when the optimizer step was skipped (e.g. found inf), else 0."""
    grad_norm: Optional[float]
    """Total gradient norm before clipping (None on ranks without trainable parameters)."""


_OBSERVERS: list[Callable[[TrainingLogEvent], None]] = []


def add_observer(fn: Callable[[TrainingLogEvent], None]) -> None:
    if fn not in _OBSERVERS:
        _OBSERVERS.append(fn)


def remove_observer(fn: Callable[[TrainingLogEvent], None]) -> None:
    if fn in _OBSERVERS:
        _OBSERVERS.remove(fn)


def _make_training_log(original):
    """Bind the call to ``original``'s own signature and read the fields by name: the positions
    differ between releases (core_v0.15 has ``decoupled_learning_rate`` fourth, so a positional
    wrapper would read the learning rate as the iteration and so on, without any error)."""
    signature = inspect.signature(original)

    def training_log(*args, **kwargs):
        result = original(*args, **kwargs)
        got = signature.bind(*args, **kwargs).arguments
        grad_norm = got.get("grad_norm")
        event = TrainingLogEvent(iteration=int(got["iteration"]), loss_dict=dict(got["loss_dict"]),
                                 learning_rate=got.get("learning_rate"),
                                 skipped_iter=int(got.get("skipped_iter", 0)),
                                 grad_norm=None if grad_norm is None else float(grad_norm))
        for fn in list(_OBSERVERS):
            fn(event)
        return result

    return training_log


PATCH = Patch(
    name=NAME,
    supported=SUPPORTED,
    why=__doc__,
    verify=check_checkout,
    targets=(Target("megatron.training.training", "training_log", _make_training_log),),
)
