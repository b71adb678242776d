"""NeMo-RL's ``examples/run_grpo.py`` run from the user's checkout, its ``setup`` wrapped so that the
loss object it returns is the plug-in's (``launch/nemo_rl_grpo.py``).

``run_grpo.main()`` calls ``setup(...)`` (a name it imports from ``nemo_rl.algorithms.grpo``) and hands
the ``loss_fn`` of its result to the trainer. The wrapper calls NeMo-RL's ``setup`` with the same
arguments and returns its result with that one element replaced by
:func:`~megatron_pg_agg.integrations.nemo_rl_plugin.use_pg_agg`'s loss. The elements are found by
type (the ``ClippedPGLossFn``, the ``MasterConfig``, the ``Policy``), not by position, and a result
without exactly one of each is refused: a NeMo-RL whose ``setup`` changed shape fails loudly.
"""
from __future__ import annotations

import importlib.util
import os
import sys

from .nemo_rl_plugin import CHECKOUT_ENV, NemoRLConfigError, checkout_problem, use_pg_agg

__all__ = ["load_run_grpo", "swap_loss", "main"]


def load_run_grpo(checkout: str):
    """NeMo-RL's ``examples/run_grpo.py`` of ``checkout`` as a module (the checkout on ``sys.path``)."""
    problem = checkout_problem(checkout)
    if problem:
        raise NemoRLConfigError(problem)
    checkout = os.path.abspath(checkout)
    if checkout not in sys.path:
        sys.path.insert(0, checkout)
    path = os.path.join(checkout, "examples", "run_grpo.py")
    spec = importlib.util.spec_from_file_location("nemo_rl_examples_run_grpo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def swap_loss(result: tuple) -> tuple:
    """``setup()``'s result with its ``ClippedPGLossFn`` replaced by the plug-in's loss."""
    from nemo_rl.algorithms.grpo import MasterConfig  # noqa: PLC0415
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossFn  # noqa: PLC0415
    from nemo_rl.models.policy.lm_policy import Policy  # noqa: PLC0415

    def only(kind) -> int:
        found = [i for i, item in enumerate(result) if isinstance(item, kind)]
        if len(found) != 1:
            raise NemoRLConfigError(f"NeMo-RL's setup() returned {len(found)} {kind.__name__} (expected one): this "
                                    "launcher was written for NeMo-RL 0.6's setup(); call use_pg_agg yourself")
        return found[0]

    loss_at, config_at, policy_at = only(ClippedPGLossFn), only(MasterConfig), only(Policy)
    swapped = list(result)
    swapped[loss_at] = use_pg_agg(result[config_at], result[policy_at], result[loss_at])
    return tuple(swapped)


def main() -> None:
    checkout = os.environ.get(CHECKOUT_ENV)
    if not checkout:
        raise SystemExit(f"set {CHECKOUT_ENV} to your NeMo-RL checkout (docs/nemo-rl.md)")
    run_grpo = load_run_grpo(checkout)
    setup = run_grpo.setup

    def setup_with_pg_agg(*args, **kwargs):
        return swap_loss(setup(*args, **kwargs))

    setup_with_pg_agg.__wrapped__ = setup
    run_grpo.setup = setup_with_pg_agg
    run_grpo.main()
