"""AReaL's PPO actor: optimizer steps that hold whole prompt groups.

WHY
    AReaL 1.0.4's ``PPOActor._ppo_update`` cuts the rank's batch into ``actor.ppo_n_minibatches``
    optimizer steps with ``split_padded_tensor_dict_into_mb_list`` (first-fit decreasing by
    sequence length, one sequence at a time), which spreads a prompt group over several steps (2
    of 4 groups with 2 steps, 4 of 4 with 4). prompt_mean divides each token by its group's valid
    tokens, which then live in two optimizer steps: no step can compute it. The actor looks the
    splitter up as a module global at that one call (``actor.py``), so wrapping that global is
    the seam; AReaL's engine calls its own copy (``areal.utils.data``) for micro-batches, which
    stays untouched (any micro-batch split is exact under the plug-in).

HOW (a wrapper, never a copy)
    ``areal.trainer.ppo.actor.split_padded_tensor_dict_into_mb_list``: when the batch carries the
    plug-in's group marks (``megatron_pg_agg.integrations.areal_loss.GROUP``, set only by the
    plug-in's ``ppo_update``), the rows are cut into ``mb_spec.n_mbs`` steps of whole groups,
    balanced by tokens (``whole_group_minibatches``), and returned as AReaL's own
    ``MicroBatchList``. Any other batch (the plug-in off) goes to the original unchanged.

TARGETS (areal 1.0.x)
    ``areal.trainer.ppo.actor.split_padded_tensor_dict_into_mb_list``. Any device.
"""
from __future__ import annotations

import inspect

from ._machinery import Patch, Target

NAME = "areal_actor"
SUPPORTED = ">=0.17,<0.20"
SUPPORTED_AREAL = ">=1.0.4,<1.1"
ACTOR = "areal.trainer.ppo.actor"


def areal_problem():
    """Why the AReaL plug-in cannot run with the installed AReaL, or None."""
    from megatron_pg_agg.versions import distribution_version, in_range  # noqa: PLC0415

    version = distribution_version("areal")
    if version is None or not in_range(version, SUPPORTED_AREAL):
        return (f"the AReaL plug-in supports areal {SUPPORTED_AREAL!r}, but "
                f"{'none' if version is None else version} is installed")
    return None


def _require_areal() -> None:
    problem = areal_problem()
    if problem is not None:
        raise RuntimeError(f"patch {NAME!r}: {problem}; nothing was patched.")


def _make_split(original):
    signature = inspect.signature(original)

    def split_padded_tensor_dict_into_mb_list(*args, **kwargs):
        from megatron_pg_agg.integrations.areal_loss import GROUP, take_rows, whole_group_minibatches  # noqa: PLC0415

        bound = signature.bind(*args, **kwargs)
        data, mb_spec = bound.arguments["data"], bound.arguments["mb_spec"]
        if GROUP not in data:
            return original(*bound.args, **bound.kwargs)
        from areal.utils.data import MicroBatchList  # noqa: PLC0415

        steps = whole_group_minibatches(data, mb_spec.n_mbs)
        forward = [row for rows in steps for row in rows]
        backward = [0] * len(forward)
        for position, row in enumerate(forward):
            backward[row] = position
        lengths = data["attention_mask"].sum(1).tolist()
        return MicroBatchList(data=data, mb_spec=mb_spec, mbs=[take_rows(data, rows) for rows in steps],
                              group_lens=[sum(lengths[r] for r in rows) for rows in steps],
                              forward_indices=forward, backward_indices=backward)

    return split_padded_tensor_dict_into_mb_list


PATCH = Patch(
    name=NAME,
    supported=SUPPORTED,
    why=__doc__,
    precondition=_require_areal,
    targets=(Target(ACTOR, "split_padded_tensor_dict_into_mb_list", _make_split),),
    unsupported_reason="AReaL 1.0.4 pins megatron-core 0.17.0; the plug-in was tested with 0.17.1.",
)
