"""The miles plug-in: miles' own conversion hook makes its Megatron loss train any of the project's modes exactly.

Two lines in a miles launch (docs/miles.md)::

    --custom-convert-samples-to-train-data-path megatron_pg_agg.integrations.miles.plugin.convert_samples_to_train_data
    --custom-config-path pg_agg.yaml        # pg_agg_mode: prompt_mean   (constant: also pg_agg_divisor: 512)

miles (radixark/miles, derived from slime) keeps slime's loss: with ``--calculate-per-token-loss`` off it
back-propagates per optimizer step ``(1/R) sum_i sum_t m_it l_it / clamp_min(D_i, 1)`` with
``D_i = rollout_mask_sums[i]`` and ``R`` the step's ``num_rollouts`` (its ``build_dp_schedule``:
``--global-batch-size`` rollouts in order of first appearance, a rollout's samples together; a smaller
last step under ``--allow-partial-train-step``). miles calls the hook on the host as ``f(args,
samples)`` in place of its default conversion (``miles.ray.rollout.train_data_conversion``). The hook:

1. refuses, naming miles' flags, what cannot be exact (:func:`config_problems`, :func:`sample_problems`);
2. runs miles' own default conversion (rewards post-processing, rollout ids, loss masks, every
   optional key), called as the rollout manager calls it without a hook;
3. reads each step's samples and ``R`` from miles' own ``build_dp_schedule`` (or, where miles splits
   on the train side, its legacy rule: ``--global-batch-size`` samples in order);
4. writes ``rollout_mask_sums[i] = W / (R * c_i)`` (the shared
   :mod:`megatron_pg_agg.integrations.slime_family`), the per-sample denominator every term divides
   by: the policy loss (PPO/GRPO, GSPO, TIS/OPSM masks), entropy, KL, and with ``--advantage-estimator
   ppo`` the critic's value loss (``J_v = sum_t c_t n_t v_t / W``).

Nothing else of miles changes: its micro-batching, DP/CP split, loss, schedule and optimizer are its own.
"""
from __future__ import annotations

import types
from typing import Optional

from megatron_pg_agg.integrations.objective import HostObjective
from megatron_pg_agg.integrations.slime_family import hook
from megatron_pg_agg.integrations.slime_family.hook import DIVISOR_KEY, MODE_KEY
from megatron_pg_agg.integrations.slime_family.weights import HostTerms, SlimeFamilyConfigError

__all__ = ["CHECKOUT_ENV", "DIVISOR_KEY", "MILES", "MODE_KEY", "MilesConfigError", "checkout_problem",
           "config_problems", "convert_samples_to_train_data", "miles_steps", "objective_from_args",
           "sample_problems"]


class MilesConfigError(SlimeFamilyConfigError):
    """A miles configuration or rollout the plug-in refuses (names the flags or the samples)."""


MILES = HostTerms("miles", MilesConfigError, "R",
                  "num_rollouts: the step's rollouts, --global-batch-size or a partial last step's")
"""miles in the shared refusals."""


def objective_from_args(args) -> HostObjective:
    """The objective of miles' ``args`` (:data:`MODE_KEY`, :data:`DIVISOR_KEY`); raises
    :class:`MilesConfigError` naming both keys."""
    return hook.objective_from_args(args, MilesConfigError)


_UNREACHABLE = {
    "use_dynamic_global_batch_size": "--use-dynamic-global-batch-size: miles derives that step size from the DP "
    "size in the rollout's metadata, which the conversion hook does not receive (miles calls it as f(args, "
    "samples)), so the hook cannot know the steps; drop the flag",
    "multi_lora": "--multi-lora: miles then divides by 1 and scales each adapter's gradient at its own step, "
    "from metadata the conversion hook does not receive; drop the flag",
    "indep_dp": "--indep-dp: each DP replica then schedules and reduces on its own (miles' independent-DP "
    "path), which the plug-in's step weights do not follow; drop the flag",
}
"""miles flags whose loss scaling the hook cannot reach, and why."""


def _backend_problems(args) -> list:
    problems = []
    if getattr(args, "train_backend", "megatron") != "megatron":
        problems.append(f"--train-backend={args.train_backend}: the plug-in makes miles' Megatron backend exact "
                        "(its FSDP backend normalises on its own path, miles #3231); use --train-backend megatron")
    if getattr(args, "object_store_backend", "ray") != "ray":
        problems.append(f"--object-store-backend={args.object_store_backend}: its schema ships rollout_mask_sums "
                        "as int64 (miles' ROLLOUT_DATA_VALUE_SPEC), which truncates the plug-in's fractional "
                        "denominators; use the default, ray")
    return problems


def config_problems(args) -> list:
    """Every reason miles' ``args`` cannot train the plug-in's objective exactly, naming the flags."""
    problems = hook.flag_problems(args, "miles") + hook.wrapper_problems(args)
    problems += [reason for key, reason in _UNREACHABLE.items() if getattr(args, key, False)]
    problems += _backend_problems(args)
    gbs = getattr(args, "global_batch_size", None)
    if not isinstance(gbs, int) or gbs < 1:
        problems.append(f"--global-batch-size={gbs!r}: the plug-in needs miles' step size in rollouts")
    return problems


def sample_problems(samples: list) -> list:
    """Rollouts the hook refuses whatever the flags: multimodal samples (miles then splits them on
    its train side by sample count, outside the rollout-side schedule the hook reads)."""
    multimodal = [i for i, s in enumerate(samples) if getattr(s, "multimodal_train_inputs", None) is not None]
    if multimodal:
        return [f"samples {multimodal[:10]} carry multimodal_train_inputs: miles then schedules the steps on its "
                "train side, which the plug-in does not read; not supported"]
    return []


def _legacy_split(args, rollout_ids: list) -> bool:
    """Whether miles splits this rollout on the train side (``split_train_data_by_dp_raw``): delayed
    split, or fewer distinct rollouts than a step (miles' ``can_schedule_on_rollout_side``)."""
    return bool(getattr(args, "delay_split_train_data_by_dp", False)) or (
        len(set(rollout_ids)) < args.global_batch_size)


def miles_steps(rollout_ids: list, args) -> tuple[list[list[int]], list[int]]:
    """``(sample indices of each optimizer step, each step's R)`` as miles trains them. Rollout-side
    schedule: miles' own ``build_dp_schedule`` on one rank, every sample its own micro-batch (the
    steps and their ``num_rollouts`` do not depend on the DP size or the packing; a partial last step
    under ``--allow-partial-train-step`` is included: where miles drops it for want of one sample per
    rank, its samples are not trained and their ``D_i`` are unused). Train-side (legacy) split:
    ``--global-batch-size`` samples in order, ``R = --global-batch-size``."""
    gbs = args.global_batch_size
    if _legacy_split(args, rollout_ids):
        if getattr(args, "balance_data", False):
            raise MilesConfigError("--balance-data with miles' train-side split (--delay-split-train-data-by-dp, or "
                                   "fewer rollouts than --global-batch-size) reorders the samples into steps the "
                                   "hook cannot read; drop one of them")
        return [list(range(k * gbs, (k + 1) * gbs)) for k in range(len(rollout_ids) // gbs)], \
            [gbs] * (len(rollout_ids) // gbs)
    from miles.utils.dp_schedule import build_dp_schedule  # noqa: PLC0415

    partial = bool(getattr(args, "allow_partial_train_step", False) and getattr(args, "use_dynamic_batch_size", False))
    one_rank = types.SimpleNamespace(use_dynamic_batch_size=True, max_tokens_per_gpu=1, micro_batch_size=1,
                                     allow_partial_train_step=partial, balance_data=False, balance_by_flops=False)
    partitions, _, samples_per_step, num_rollouts = build_dp_schedule(
        one_rank, {"dp_size": 1, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1},
        [2] * len(rollout_ids), global_batch_size=gbs, rollout_indices=list(rollout_ids))
    order, steps, start = partitions[0], [], 0
    for size in samples_per_step:  # a 1-token budget: one sample per micro-batch
        steps.append(order[start:start + size])
        start += size
    return steps, list(num_rollouts)


def default_conversion(args, samples: list) -> dict:
    """miles' own default conversion of ``samples``, as the rollout manager runs it without a custom
    hook (its reward post-processing hook included; no metadata: the flags that need some are refused)."""
    from miles.ray.rollout.train_data_conversion import convert_samples_to_train_data as convert  # noqa: PLC0415
    from miles.utils.misc import load_function  # noqa: PLC0415

    path = getattr(args, "custom_reward_post_process_path", None)
    return convert(args, samples, metadata={}, custom_convert_samples_to_train_data_func=None,
                   custom_reward_post_process_func=load_function(path) if path else None)


def convert_samples_to_train_data(args, samples: list, objective: Optional[HostObjective] = None) -> dict:
    """miles' ``--custom-convert-samples-to-train-data-path`` hook (module docstring): miles' default
    conversion with ``rollout_mask_sums`` replaced by the plug-in's denominators. ``objective`` None:
    from ``args`` (:func:`objective_from_args`). Raises :class:`MilesConfigError` naming the flags or
    samples it refuses."""
    objective = objective if objective is not None else objective_from_args(args)
    hook.refuse(config_problems(args) + sample_problems(samples), MILES)
    denominators = hook.denominator_masks(samples)
    data = default_conversion(args, samples)
    steps, sizes = miles_steps(data["rollout_ids"], args)
    return hook.write_denominators(data, samples, denominators, steps, sizes, objective, MILES)


CHECKOUT_ENV = "MEGATRON_PG_AGG_MILES"
"""A miles checkout's folder (the one holding the ``miles`` package), for the project's tests and tools
that import miles from outside a miles launch."""


def checkout_problem(path: Optional[str]) -> Optional[str]:
    """None when ``path`` is a miles checkout with what the plug-in uses (per-step ``num_rollouts``
    in its ``build_dp_schedule``), else why not."""
    return hook.checkout_problem(path, env=CHECKOUT_ENV, package="miles", module="miles/utils/dp_schedule.py",
                                 needle="num_rollouts", why="miles' per-rollout step divisor")
