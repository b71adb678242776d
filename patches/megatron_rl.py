"""Megatron-LM's RL loop (train_rl.py, ``megatron/rl``): two seams, and two defects that break a run.

WHY
    * **The seams.** Megatron-LM's RL loop has no hook for where a collection's rollouts come from
      or for how they become optimizer steps. ``rl_utils.get_grpo_data_iterator`` looks both up
      as module globals at every collection: ``get_environment_rollouts`` (the environments and
      the inference engine) and ``prepare_data_for_update`` (advantages, the DP split, the old and
      reference log-probs, the data iterator). The RL entry registers its planner for the second
      (:func:`set_collection_planner`: whole prompt groups per optimizer step, the step weights
      before the split) and, when replaying recorded rollouts, a source for the first
      (:func:`set_rollout_source`). With nothing registered each wrapper is the original.
    * **The packed step's microbatch count.** ``train_step`` runs the schedule with
      ``num_microbatches=get_num_microbatches()``, and the same count times the micro-batch and DP
      sizes is what ``train()`` adds to the consumed samples and what the learning-rate schedule
      steps by. A packed step holds ``B`` sequences in fewer THD microbatches, so one count cannot
      serve both (Megatron-LM's own ``--rl-use-sequence-packing`` gives the schedule the bin count,
      and its learning rate then advances by bins: Megatron-LM #3078). The RL entry keeps
      Megatron-LM's calculator at ``B / DP`` per rank (its samples and schedule are then those of
      the unpacked run) and registers the planned step's count for the schedule alone
      (:func:`set_microbatch_count`).
    * **fp32_output.** ``rl_utils.get_logprobs`` calls the model with ``fp32_output=not (fp16 or
      bf16)``. Only ``Float16Module`` (the fp16/bf16 wrapper) takes that keyword; ``GPTModel.forward``
      has no such parameter. So every fp32 run (no ``--bf16``/``--fp16``: every CPU run, and a GPU
      run in full precision) fails at its first log-prob pass with ``TypeError: GPTModel.forward()
      got an unexpected keyword argument 'fp32_output'``. Present at every tag up to core_v0.19.0.
      ``fp32_output=True`` asks for fp32 logits; a ``GPTModel`` that receives it is not wrapped in
      ``Float16Module`` (the wrapper consumes the keyword), so its logits are already fp32 and the
      keyword is dropped with no change to any value.
    * **The hard exit.** ``rl_utils.rl_inference_interface_shutdown()`` ends in ``os._exit(0)``
      (upstream's workaround for the inference server's non-daemon threads). ``pretrain()`` calls
      it at its end, so with it nothing after ``pretrain()`` runs and the exit status is always 0.
      When no inference interface and no rollout generator were ever made (rollouts replayed from
      a file, ``--pg-replay-rollouts``), there is nothing to shut down: the call is skipped. With a
      live inference interface (a real run) the original runs, hard exit included.

HOW (wrappers only, never a copy of an upstream function)
    * ``rl_utils.get_environment_rollouts`` and ``rl_utils.prepare_data_for_update``: their
      arguments bound by name; the registered function gets them by name, else the original runs.
    * ``GPTModel.forward``: drops ``fp32_output=True`` (raises on ``fp32_output=False``, which asks
      for reduced-precision logits a bare ``GPTModel`` cannot give), then calls the original. Only
      where ``GPTModel.forward`` has no ``fp32_output`` parameter.
    * ``megatron.training.training.get_forward_backward_func`` (``train()`` looks it up there once):
      the schedule it returns is wrapped; with a count registered, a training call (not
      ``forward_only``) gets ``num_microbatches`` from it, bound by name; otherwise the original.
    * ``rl_utils.rl_inference_interface_shutdown``: returns at once when the module's
      ``_INFERENCE_INTERFACE`` and ``_ROLLOUT_GENERATOR`` are both None, else calls the original.

TARGETS (megatron-core >=0.19,<0.20 with Megatron-LM core_v0.19.x, the RL entry's one release)
    ``megatron.core.models.gpt.gpt_model.GPTModel.forward``, and in ``megatron.rl.rl_utils``
    ``get_environment_rollouts``, ``prepare_data_for_update``, ``rl_inference_interface_shutdown``;
    ``megatron.training.training.get_forward_backward_func``. Any device.
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Callable, Optional

from ._machinery import Patch, Target
from ._megatron_lm_release import check_checkout

NAME = "megatron_rl"
SUPPORTED = ">=0.19.0,<0.20"
UNSUPPORTED_REASON = ("the RL entry targets Megatron-LM's RL loop of core_v0.19.x (megatron/rl changed by "
                      "thousands of lines between core_v0.16 and core_v0.19); install megatron-core 0.19.x "
                      "and use a core_v0.19.x checkout")
RL_UTILS = "megatron.rl.rl_utils"
GPT_MODEL = "megatron.core.models.gpt.gpt_model"
TRAINING = "megatron.training.training"

_ROLLOUT_SOURCE: Optional[Callable] = None
_COLLECTION_PLANNER: Optional[Callable] = None
_MICROBATCH_COUNT: Optional[Callable[[], int]] = None


def set_rollout_source(source: Optional[Callable]) -> None:
    """``source(model=, inference_model=, optimizer=, n_prompts=, samples_per_group=)`` -> the
    collection's groups (the same on every rank), in place of the environments; None: Megatron-LM's."""
    global _ROLLOUT_SOURCE
    _ROLLOUT_SOURCE = source


def set_collection_planner(planner: Optional[Callable]) -> None:
    """``planner(model=, ref_state_dict=, rollouts=, tokenizer=, sequence_packing=, is_correction=)``
    -> ``(data iterator, group stats, example groups)`` as ``prepare_data_for_update`` returns;
    None: Megatron-LM's."""
    global _COLLECTION_PLANNER
    _COLLECTION_PLANNER = planner


def set_microbatch_count(count: Optional[Callable[[], int]]) -> None:
    """``count()`` -> the microbatches (per DP rank) the next training schedule call runs: the
    planned step's. Megatron-LM's microbatch calculator, its consumed samples and its learning-rate
    schedule are left alone. None: the schedule gets Megatron-LM's ``get_num_microbatches()``."""
    global _MICROBATCH_COUNT
    _MICROBATCH_COUNT = count


def _make_schedule_getter(original):
    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        schedule = original(*args, **kwargs)
        signature = inspect.signature(schedule)

        @functools.wraps(schedule)
        def forward_backward(*a, **kw):
            count = _MICROBATCH_COUNT
            bound = signature.bind(*a, **kw)
            if count is None or bound.arguments.get("forward_only"):
                return schedule(*a, **kw)
            bound.arguments["num_microbatches"] = count()
            return schedule(*bound.args, **bound.kwargs)

        return forward_backward

    return get_forward_backward_func


def _make_dispatch(registered: Callable[[], Optional[Callable]]):
    def make(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def dispatch(*args, **kwargs):
            replacement = registered()
            if replacement is None:
                return original(*args, **kwargs)
            return replacement(**signature.bind(*args, **kwargs).arguments)

        return dispatch

    return make


def _make_forward(original):
    if "fp32_output" in inspect.signature(original).parameters:  # a release that fixed it
        return original

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if "fp32_output" in kwargs and not kwargs.pop("fp32_output"):
            raise TypeError("GPTModel.forward got fp32_output=False: reduced-precision logits need the "
                            "Float16Module wrapper (--bf16/--fp16), which consumes the keyword")
        return original(self, *args, **kwargs)

    return forward


def _make_shutdown(original):
    @functools.wraps(original)
    def rl_inference_interface_shutdown(*args, **kwargs):
        rl_utils = sys.modules[RL_UTILS]
        if rl_utils._INFERENCE_INTERFACE is None and rl_utils._ROLLOUT_GENERATOR is None:
            return None  # nothing was started; the original would only warn and os._exit(0)
        return original(*args, **kwargs)

    return rl_inference_interface_shutdown


PATCH = Patch(
    name=NAME,
    supported=SUPPORTED,
    why=__doc__,
    unsupported_reason=UNSUPPORTED_REASON + ".",
    verify=check_checkout,
    targets=(
        Target(GPT_MODEL, "GPTModel.forward", _make_forward),
        Target(RL_UTILS, "get_environment_rollouts", _make_dispatch(lambda: _ROLLOUT_SOURCE)),
        Target(RL_UTILS, "prepare_data_for_update", _make_dispatch(lambda: _COLLECTION_PLANNER)),
        Target(RL_UTILS, "rl_inference_interface_shutdown", _make_shutdown),
        Target(TRAINING, "get_forward_backward_func", _make_schedule_getter),
    ),
)
