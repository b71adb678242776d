"""What the two step-factor patches (:mod:`.moe_aux_loss`, :mod:`.mtp_loss`) share: the host-integer
check of a step factor's inputs, and the ``set_loss_scale`` wrapper that multiplies megatron-core's
auxiliary-loss scale by the factor of the current step.

Why a per-step factor: megatron-core's auto-scalers keep one class-level scale read at backward
time, and under 1F1B a later forward resets it before an earlier backward, so the factor must be
the same for every microbatch of a step; it comes from host integers the planner knows (no
collective, no host sync)."""
from __future__ import annotations

import numbers
from typing import Callable, Optional


def require_host_ints(**values) -> None:
    """TypeError naming the first value that is not a Python (or numpy) integer: a tensor here
    would mean a host sync per step, a float a count that is not one."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int (a host integer from the plan), got {type(value).__name__}")


def plain_function(original):
    """The function of a staticmethod (the auto-scalers' methods are staticmethods upstream)."""
    return original.__func__ if isinstance(original, staticmethod) else original


def make_scaled_set_loss_scale(factor: Callable[[], Optional[float]]):
    """A ``Target.make`` for an auto-scaler's ``set_loss_scale(scale)``: while ``factor()`` is not
    None, the original stores ``scale * factor()``. The replacement is a plain function on the
    class (a staticmethod upstream; the schedule calls it through the class, where a plain
    function is not bound, and a staticmethod object cannot carry the machinery's ``__wrapped__``)."""

    def make(original):
        fn = plain_function(original)

        def set_loss_scale(scale):
            step = factor()
            if step is not None:
                scale = scale * step  # a Python float times the device tensor: no host sync
            return fn(scale)

        return set_loss_scale

    return make
