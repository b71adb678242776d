"""The slime plug-in: slime's own conversion hook makes its Megatron loss train any of the project's modes exactly.

Two lines in a slime launch (docs/slime.md)::

    --custom-convert-samples-to-train-data-path megatron_pg_agg.integrations.slime.plugin.convert_samples_to_train_data
    --custom-config-path pg_agg.yaml        # pg_agg_mode: prompt_mean   (constant: also pg_agg_divisor: 512)

slime calls the hook on the host, with the whole rollout, in place of its default conversion
(``RolloutManager._convert_samples_to_train_data``). The hook:

1. checks the configuration once per call and refuses, naming slime's flags, what cannot be exact
   (:func:`config_problems`: the base args and each role's ``--megatron-config-path`` overrides);
2. runs slime's own default conversion (the unbound method of ``RolloutManager``'s class, the one
   ``@ray.remote`` wraps: rewards post-processing, rollout ids, loss masks, every optional key);
3. computes each step's token weights with the project's ``token_weights`` over slime's own step
   grouping (slime's ``build_dp_schedule``: ``--global-batch-size`` rollouts in order of first
   appearance), the loss mask before slime's ``remove_sample`` zeroing as the denominator mask
   and slime's loss mask as the numerator mask (the filtered-numerator rule);
4. writes ``rollout_mask_sums[i] = W / (gbs * c_i)``
   (:mod:`megatron_pg_agg.integrations.slime.weights`), the per-sample denominator slime's
   ``get_sum_of_sample_mean`` divides by in every term: the policy loss, entropy, KL, clip fraction,
   and with ``--advantage-estimator ppo`` the critic's value loss (slime trains its critic on the
   same rollout data: ``J_v = sum_t c_t n_t v_t / W``, the value term in the policy's mode).

Nothing else of slime changes: its micro-batching, DP/CP split, loss, schedule and optimizer are its
own. Rejection sampling inside slime's loss (TIS/RS masks) keeps ``rollout_mask_sums`` as the
denominators, which is the filtered-numerator rule too.
"""
from __future__ import annotations

import types
from typing import Optional

from megatron_pg_agg.integrations.objective import HostObjective
from megatron_pg_agg.integrations.slime.weights import SLIME, SlimeConfigError
from megatron_pg_agg.integrations.slime_family import hook
from megatron_pg_agg.integrations.slime_family.hook import DIVISOR_KEY, MODE_KEY

__all__ = ["DIVISOR_KEY", "MODE_KEY", "SlimeConfigError", "config_problems", "convert_samples_to_train_data",
           "objective_from_args", "role_args", "slime_steps"]


def objective_from_args(args) -> HostObjective:
    """The objective of slime's ``args`` (:data:`MODE_KEY`, :data:`DIVISOR_KEY`); raises
    :class:`SlimeConfigError` naming both keys."""
    return hook.objective_from_args(args, SlimeConfigError)


def _flag_problems(args, role: str = "actor") -> list:
    return hook.flag_problems(args, "slime", role) + hook.wrapper_problems(args)


def _roles(args) -> list:
    """The training roles slime starts: the actor, and the critic with ``--advantage-estimator ppo``."""
    return ["actor", "critic"] if getattr(args, "use_critic", False) else ["actor"]


_ROLE_ARGS: dict = {}
"""``(path, role) -> (args, role args)`` of the last base args seen: the hook runs every rollout with
the same args; slime parses (and logs) the roles once, at start-up."""


def role_args(args, role: str):
    """The args slime gives ``role``'s Megatron process: slime's own ``parse_megatron_role_args`` over
    ``--megatron-config-path`` (``create_actor_model`` / ``create_training_models``), else the base args."""
    path = getattr(args, "megatron_config_path", None)
    if not path:
        return args
    cached = _ROLE_ARGS.get((path, role))
    if cached is None or cached[0] is not args:
        from slime.utils.arguments import parse_megatron_role_args  # noqa: PLC0415

        cached = _ROLE_ARGS[(path, role)] = (args, parse_megatron_role_args(args, path, role=role))
    return cached[1]


def config_problems(args) -> list:
    """Every reason slime's ``args`` cannot train the plug-in's objective exactly, naming the flags:
    the base args (what the rollout manager, its step grouping and this hook see) and, with
    ``--megatron-config-path``, each role's overrides (the actor's, and the critic's under
    ``--advantage-estimator ppo``: its value loss divides by the same ``rollout_mask_sums``)."""
    problems = _flag_problems(args)
    gbs = getattr(args, "global_batch_size", None)
    if not isinstance(gbs, int) or gbs < 1:
        problems.append(f"--global-batch-size={gbs!r}: the plug-in needs slime's step size in rollouts")
    path = getattr(args, "megatron_config_path", None)
    if path:
        for role in _roles(args):
            problems += [f"--megatron-config-path {path} ({role} overrides): {problem}"
                         for problem in _flag_problems(role_args(args, role), role)
                         if problem not in problems]
    return problems


def slime_steps(rollout_ids: list, global_batch_size: int) -> list[list[int]]:
    """The sample indices of each optimizer step, from slime's own ``build_dp_schedule`` (one DP
    rank, one sample per micro-batch: the step membership does not depend on the DP size or the
    micro-batching). Trailing rollouts slime drops are in no step."""
    from slime.utils.dp_schedule import build_dp_schedule  # noqa: PLC0415

    one_rank = types.SimpleNamespace(use_dynamic_batch_size=False, micro_batch_size=1, max_tokens_per_gpu=None,
                                     balance_data=False, balance_by_flops=False)
    partitions, _, num_microbatches, _ = build_dp_schedule(
        one_rank, {"dp_size": 1, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1},
        [1] * len(rollout_ids), global_batch_size=global_batch_size, rollout_indices=list(rollout_ids))
    order, steps, start = partitions[0], [], 0
    for size in num_microbatches:
        steps.append(order[start:start + size])
        start += size
    return steps


def _manager_class():
    """slime's ``RolloutManager`` class itself (``@ray.remote`` keeps it as ``__ray_actor_class__``)."""
    from slime.ray.rollout import RolloutManager  # noqa: PLC0415

    try:
        return object.__getattribute__(RolloutManager, "__ray_actor_class__")
    except AttributeError:
        return RolloutManager


def default_conversion(args, samples: list) -> dict:
    """slime's own default conversion (``RolloutManager._convert_samples_to_train_data``) of ``samples``,
    as the rollout manager runs it without a custom hook (its reward post-processing hook included)."""
    from slime.utils.misc import load_function  # noqa: PLC0415

    manager = object.__new__(_manager_class())  # no __init__: the method reads only these
    manager.args = args
    manager.custom_convert_samples_to_train_data_func = None
    path = getattr(args, "custom_reward_post_process_path", None)
    manager.custom_reward_post_process_func = load_function(path) if path else None
    return manager._convert_samples_to_train_data(samples)


def convert_samples_to_train_data(args, samples: list, objective: Optional[HostObjective] = None) -> dict:
    """slime's ``--custom-convert-samples-to-train-data-path`` hook (module docstring): slime's default
    conversion with ``rollout_mask_sums`` replaced by the plug-in's denominators. ``objective``
    None: from ``args`` (:func:`objective_from_args`). Raises :class:`SlimeConfigError` naming the
    flags or samples it refuses."""
    objective = objective if objective is not None else objective_from_args(args)
    hook.refuse(config_problems(args), SLIME)
    denominators = hook.denominator_masks(samples)
    data = default_conversion(args, samples)
    steps = slime_steps(data["rollout_ids"], args.global_batch_size)
    return hook.write_denominators(data, samples, denominators, steps, [args.global_batch_size] * len(steps),
                                   objective, SLIME)


CHECKOUT_ENV = "MEGATRON_PG_AGG_SLIME"
"""A slime checkout's folder (the one holding the ``slime`` package), for the project's tests and
tools that import slime from outside a slime launch (slime is not on the package index)."""


def checkout_problem(path: Optional[str]) -> Optional[str]:
    """None when ``path`` is a slime checkout with what the plug-in uses (``rollout_mask_sums``:
    slime #1933 or later), else why not."""
    return hook.checkout_problem(path, env=CHECKOUT_ENV, package="slime", module="slime/ray/rollout.py",
                                 needle="rollout_mask_sums", why="slime #1933")
