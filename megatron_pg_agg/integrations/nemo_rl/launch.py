"""NeMo-RL's ``examples/run_grpo.py`` run from the user's checkout, with the plug-in's checks before
NeMo-RL spends anything and its loss in place of NeMo-RL's (``launch/nemo_rl_grpo.py``).

``run_grpo.main()`` loads the config (``--config`` and Hydra overrides) into ``MasterConfig(**config)``,
then starts Ray, loads the tokenizer and the data, calls ``setup(...)`` (policy and generation
workers; names it imports from ``nemo_rl.algorithms.grpo``) and hands the ``loss_fn`` of its result to
the trainer. Two names of that module are wrapped:

* ``MasterConfig``: the config is built by NeMo-RL's own class, then
  :func:`~megatron_pg_agg.integrations.nemo_rl.plugin.check_config` runs on it (every check
  ``use_pg_agg`` runs), before Ray, the tokenizer, the data and ``setup()``;
* ``setup``: the same checks on the config it is handed, before NeMo-RL's ``setup`` runs (should a
  NeMo-RL build its config another way), then NeMo-RL's ``setup`` with the same arguments, its
  result with the loss replaced by :func:`~megatron_pg_agg.integrations.nemo_rl.plugin.use_pg_agg`'s.
  The elements are found by type (the ``ClippedPGLossFn``, the ``MasterConfig``, the ``Policy``), not
  by position, and a result without exactly one of each is refused: a NeMo-RL whose ``setup``
  changed shape fails loudly.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import sys

from megatron_pg_agg.integrations.nemo_rl.plugin import (
    CHECKOUT_ENV,
    NemoRLConfigError,
    check_config,
    checkout_problem,
    use_pg_agg,
)

__all__ = ["load_run_grpo", "swap_loss", "wrap_run_grpo", "main"]


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


def checked_master_config(master_config_class):
    """``master_config_class`` (NeMo-RL's ``MasterConfig``) as a callable that builds the config and
    runs the plug-in's checks on it before returning it."""

    def build(*args, **kwargs):
        config = master_config_class(*args, **kwargs)
        check_config(config)
        return config

    build.__wrapped__ = master_config_class
    return build


def checked_setup(setup):
    """NeMo-RL's ``setup``: the plug-in's checks on its ``master_config`` first, then ``setup`` itself,
    its result with the plug-in's loss (:func:`swap_loss`)."""
    signature = inspect.signature(setup)

    def setup_with_pg_agg(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        check_config(arguments.get("master_config", next(iter(arguments.values()), None)))  # its first argument
        return swap_loss(setup(*args, **kwargs))

    setup_with_pg_agg.__wrapped__ = setup
    return setup_with_pg_agg


def wrap_run_grpo(run_grpo) -> None:
    """The two changes to NeMo-RL's ``run_grpo`` module (module docstring), in place."""
    if not hasattr(run_grpo, "MasterConfig") or not hasattr(run_grpo, "setup"):
        raise NemoRLConfigError("NeMo-RL's examples/run_grpo.py has no MasterConfig or setup: this launcher was "
                                "written for NeMo-RL 0.6's; call use_pg_agg yourself (docs/nemo-rl.md)")
    run_grpo.MasterConfig = checked_master_config(run_grpo.MasterConfig)
    run_grpo.setup = checked_setup(run_grpo.setup)


def main() -> None:
    checkout = os.environ.get(CHECKOUT_ENV)
    if not checkout:
        raise SystemExit(f"set {CHECKOUT_ENV} to your NeMo-RL checkout (docs/nemo-rl.md)")
    run_grpo = load_run_grpo(checkout)
    wrap_run_grpo(run_grpo)
    run_grpo.main()
