"""The conversion hook's part slime and miles share: the config block, the common refusals, the denominators written.

Both hosts call ``--custom-convert-samples-to-train-data-path`` as ``f(args, samples)`` on the host with
the whole rollout and train on the returned ``rollout_mask_sums`` (:mod:`.weights`). A host's plug-in
runs its own default conversion and step grouping, then :func:`write_denominators`.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from megatron_pg_agg.integrations.objective import HostObjective, refused_as
from megatron_pg_agg.integrations.slime_family.weights import HostTerms, step_denominators

__all__ = ["DIVISOR_KEY", "MODE_KEY", "checkout_problem", "denominator_masks", "flag_problems",
           "objective_from_args", "refuse", "wrapper_problems", "write_denominators"]

MODE_KEY = "pg_agg_mode"
"""The key of the host's ``--custom-config-path`` YAML (set on the host's args) naming the mode."""
DIVISOR_KEY = "pg_agg_divisor"
"""constant's divisor L (same YAML)."""


def objective_from_args(args, error: type) -> HostObjective:
    """The objective of the host's ``args`` (:data:`MODE_KEY`, :data:`DIVISOR_KEY`); raises ``error``
    naming both keys."""
    mode = getattr(args, MODE_KEY, None)
    if not mode:
        raise error(f"{MODE_KEY} is not set: give --custom-config-path with a YAML holding "
                    f"'{MODE_KEY}: <token_mean|seq_mean|prompt_mean|constant>' (and '{DIVISOR_KEY}: L' for constant)")
    mode, divisor = str(mode), getattr(args, DIVISOR_KEY, None)
    divisor = None if divisor is None else float(divisor)
    with refused_as(error, f"{MODE_KEY}={mode!r}, {DIVISOR_KEY}={divisor!r}"):
        return HostObjective(mode, divisor)


def flag_problems(args, host: str, role: str = "actor") -> list:
    """The flags both hosts share that take a role's loss out of the plug-in's objective: a critic's
    value loss reads only --calculate-per-token-loss (its reducer is always get_sum_of_sample_mean),
    the actor's policy loss both."""
    problems = []
    if getattr(args, "calculate_per_token_loss", False):
        problems.append(f"--calculate-per-token-loss: {host} then divides by its own token count "
                        "(sum of clamp_min(mask sum, 1)) and ignores rollout_mask_sums; drop the flag (every mode, "
                        "token_mean included, comes from the plug-in)")
    if role == "actor" and getattr(args, "custom_pg_loss_reducer_function_path", None):
        problems.append(f"--custom-pg-loss-reducer-function-path={args.custom_pg_loss_reducer_function_path}: "
                        "the reducer replaces get_sum_of_sample_mean for the policy loss and sees no per-sample "
                        "denominators, so the policy term would not follow the plug-in's weights; drop the flag")
    return problems


def wrapper_problems(args) -> list:
    """megatron-core's FSDP wrappers through Megatron-LM's flags in the host's argv (slime and miles
    parse them): the plug-in's objective is verified under megatron-core's DDP only. The host runs
    without --calculate-per-token-loss here (refused above), where torch FSDP2's own average over
    DP x CP stands in for DDP's, so the lost division of
    :data:`~megatron_pg_agg.megatron.config_checks.TORCH_FSDP2_REASON` does not arise by reading;
    refused as unverified, as Megatron-FSDP on every entry (Megatron-LM #7452, finding 12)."""
    problems = []
    if getattr(args, "use_torch_fsdp2", False):
        from megatron_pg_agg.megatron.config_checks import TORCH_FSDP2_REASON  # noqa: PLC0415

        problems.append(f"--use-torch-fsdp2: the plug-in's objective is verified with megatron-core's DDP only; "
                        f"{TORCH_FSDP2_REASON}")
    if getattr(args, "use_megatron_fsdp", False):
        problems.append("--use-megatron-fsdp: a Megatron-FSDP checkpoint saved at one pipeline size loads the wrong "
                        "layers at another without an error (Megatron-LM #7452, finding 12), and the plug-in's "
                        "objective is verified with megatron-core's DDP only; drop the flag")
    return problems


def refuse(problems: list, host: HostTerms) -> None:
    """Raise ``host.error`` listing ``problems`` (none: return)."""
    if problems:
        raise host.error(f"megatron_pg_agg refuses this {host.name} configuration:\n- " + "\n- ".join(problems))


def denominator_masks(samples: list) -> list:
    """Each sample's loss mask before the host's conversion zeroes a removed sample's (it changes the Sample)."""
    return [list(s.loss_mask) if s.loss_mask is not None else [1] * s.response_length for s in samples]


def _name(position: int, sample) -> str:
    return (f"sample {position} (Sample.index {getattr(sample, 'index', None)}, "
            f"group_index {getattr(sample, 'group_index', None)})")


def write_denominators(data: dict, samples: list, denominators: list, steps: Sequence[Sequence[int]],
                       step_sizes: Sequence[int], objective: HostObjective, host: HostTerms) -> dict:
    """``data`` (the host's converted rollout) with ``rollout_mask_sums`` replaced by the plug-in's
    ``D_i`` (:func:`.weights.step_denominators`): the denominator masks read before the conversion,
    the host's loss masks as the numerator masks (the filtered-numerator rule)."""
    data["rollout_mask_sums"] = step_denominators(
        denominators, data["loss_masks"], steps, [s.group_index for s in samples], step_sizes=step_sizes,
        objective=objective, host=host, names=[_name(i, s) for i, s in enumerate(samples)])
    return data


def checkout_problem(path: Optional[str], *, env: str, package: str, module: str, needle: str,
                     why: str) -> Optional[str]:
    """None when ``path`` is a checkout of ``package`` whose ``module`` (a path inside it) holds
    ``needle`` (what the plug-in uses; ``why`` names the change that added it), else why not."""
    if not path:
        return f"no {package} checkout: set {env} to one (docs/{package}.md)"
    file = os.path.join(path, *module.split("/"))
    if not os.path.isfile(file):
        return f"{env}={path} is not a {package} checkout (no {module})"
    with open(file) as f:
        if needle not in f.read():
            return f"the {package} checkout {path} predates {needle} ({why}): update it"
    return None
