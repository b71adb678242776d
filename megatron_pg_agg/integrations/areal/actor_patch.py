"""AReaL's PPO actor and critic: optimizer steps that hold whole prompt groups; the critic's value head inside DDP.

WHY
    AReaL 1.0.4's ``PPOActor._ppo_update`` cuts the rank's batch into ``actor.ppo_n_minibatches``
    optimizer steps with ``split_padded_tensor_dict_into_mb_list`` (first-fit decreasing by
    sequence length, one sequence at a time), which spreads a prompt group over several steps (2
    of 4 groups with 2 steps, 4 of 4 with 4). prompt_mean divides each token by its group's valid
    tokens, which then live in two optimizer steps: no step can compute it. The actor looks the
    splitter up as a module global at that one call (``actor.py``), so wrapping that global is
    the seam; AReaL's engine calls its own copy (``areal.utils.data``) for micro-batches, which
    stays untouched (any micro-batch split is exact under the plug-in). ``PPOCritic._ppo_update``
    cuts the critic's ``critic.ppo_n_minibatches`` steps with the same function, its own module
    global (``critic.py``): the same wrapper.

    AReaL 1.0.4's ``make_mcore_model`` (mbridge) puts the critic's ``ValueHead`` in place of the
    output layer after mbridge wrapped the model in megatron-core's DDP, so the head is in none of
    DDP's gradient buffers: with a model whose output layer is not tied to the embedding, the
    distributed optimizer (AReaL's default) fails at start-up (``KeyError`` on the replaced output
    weight, in ``_build_optimizer_group_ranges``; without it AReaL's checkpointer asserts it); with a
    tied one the head's gradient is neither reduced over DP nor ever stepped, and the head keeps its
    random initialisation (measured on CPU: gradient norm 2.1, change 0.0 after a step). The head is
    put in place through mbridge's own ``post_model_creation_callbacks``, with AReaL's own
    ``_replace_output_layer_with_value_head``, before DDP: in its buffers, broadcast over DP with the
    rest of the model, reduced and stepped.

HOW (wrappers, never copies)
    ``areal.trainer.ppo.actor.split_padded_tensor_dict_into_mb_list`` and
    ``areal.trainer.ppo.critic.split_padded_tensor_dict_into_mb_list``: when the batch carries the
    plug-in's group marks (``megatron_pg_agg.integrations.areal.loss.GROUP``, set only by the
    plug-in's ``ppo_update``), the rows are cut into ``mb_spec.n_mbs`` steps of whole groups,
    balanced by tokens (``whole_group_minibatches``), and returned as AReaL's own
    ``MicroBatchList``. Any other batch (the plug-in off) goes to the original unchanged.
    ``areal.engine.megatron_engine.make_mcore_model``: for a critic built with mbridge, the original
    runs as for a language model, with the bridge's ``get_model`` handed one more
    ``post_model_creation_callbacks`` entry that installs the value head on the last pipeline stage;
    every other call goes to the original unchanged.

TARGETS (areal 1.0.x)
    ``areal.trainer.ppo.actor.split_padded_tensor_dict_into_mb_list``,
    ``areal.trainer.ppo.critic.split_padded_tensor_dict_into_mb_list``,
    ``areal.engine.megatron_engine.make_mcore_model``. Any device.
"""
from __future__ import annotations

import inspect

from megatron_pg_agg.patches._machinery import Patch, Target

NAME = "areal_actor"
SUPPORTED = ">=0.17,<0.20"
SUPPORTED_AREAL = ">=1.0.4,<1.1"
ACTOR = "areal.trainer.ppo.actor"
CRITIC = "areal.trainer.ppo.critic"
ENGINE = "areal.engine.megatron_engine"


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


def _make_split(role: str):
    """The splitter's wrapper for ``role`` (``actor`` or ``critic``: the key a refusal names)."""

    def make(original):
        return _whole_group_split(original, f"{role}.ppo_n_minibatches")

    return make


def _whole_group_split(original, key: str):
    signature = inspect.signature(original)

    def split_padded_tensor_dict_into_mb_list(*args, **kwargs):
        from megatron_pg_agg.integrations.areal.loss import GROUP, take_rows, whole_group_minibatches  # noqa: PLC0415

        bound = signature.bind(*args, **kwargs)
        data, mb_spec = bound.arguments["data"], bound.arguments["mb_spec"]
        if GROUP not in data:
            return original(*bound.args, **bound.kwargs)
        from areal.utils.data import MicroBatchList  # noqa: PLC0415

        steps = whole_group_minibatches(data, mb_spec.n_mbs, key)
        forward = [row for rows in steps for row in rows]
        backward = [0] * len(forward)
        for position, row in enumerate(forward):
            backward[row] = position
        lengths = data["attention_mask"].sum(1).tolist()
        return MicroBatchList(data=data, mb_spec=mb_spec, mbs=[take_rows(data, rows) for rows in steps],
                              group_lens=[sum(lengths[r] for r in rows) for rows in steps],
                              forward_indices=forward, backward_indices=backward)

    return split_padded_tensor_dict_into_mb_list


def _make_model_builder(original):
    signature = inspect.signature(original)

    def make_mcore_model(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        bridge = arguments["bridge"]
        if not (arguments["is_critic"] and bridge is not None and arguments["bridge_type"] == "mbridge"):
            return original(*bound.args, **bound.kwargs)
        from areal.models.mcore.registry import _replace_output_layer_with_value_head  # noqa: PLC0415

        tf_config = arguments["tf_config"]

        def install_value_head(model, *, post_process=True, **_):
            if post_process:  # the stage that holds the output layer (AReaL loads value_head.pt there)
                _replace_output_layer_with_value_head(model, tf_config)

        get_model = bridge.get_model

        def get_model_with_value_head(*get_args, **get_kwargs):
            callbacks = list(get_kwargs.pop("post_model_creation_callbacks", None) or ())
            return get_model(*get_args, post_model_creation_callbacks=[*callbacks, install_value_head], **get_kwargs)

        bridge.get_model = get_model_with_value_head  # this call only: an attribute of the instance
        try:
            return original(**{**arguments, "is_critic": False})  # the head is in place already
        finally:
            del bridge.get_model

    return make_mcore_model


PATCH = Patch(
    name=NAME,
    supported=SUPPORTED,
    why=__doc__,
    precondition=_require_areal,
    targets=(Target(ACTOR, "split_padded_tensor_dict_into_mb_list", _make_split("actor")),
             Target(CRITIC, "split_padded_tensor_dict_into_mb_list", _make_split("critic")),
             Target(ENGINE, "make_mcore_model", _make_model_builder)),
    unsupported_reason="AReaL 1.0.4 pins megatron-core 0.17.0; the plug-in was tested with 0.17.1.",
)
