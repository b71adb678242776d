"""Which Megatron-LM training side this project supports, and how a checkout is recognised.

Megatron-LM is used from a user's checkout (``--megatron-lm PATH`` or ``MEGATRON_LM_PATH``); its
training side (``megatron.training``) has no version of its own, so a release is recognised by
the signature of ``megatron.training.pretrain``, the one entry the project calls: the tags
``core_v0.16.x`` take an ``extra_args_provider`` (Megatron-LM main dropped it) and the
parameters below. The megatron-core release that comes with it is checked separately (0.16.x).
"""
from __future__ import annotations

import inspect

SUPPORTED_TAGS = "core_v0.16.x"
"""The Megatron-LM tags whose training side the project was written and tested against."""

PRETRAIN_PARAMETERS = (
    "train_valid_test_dataset_provider", "model_provider", "model_type", "forward_step_func",
    "process_non_loss_data_func", "extra_args_provider", "args_defaults", "get_embedding_ranks",
    "get_position_embedding_ranks", "non_loss_data_func", "store", "inprocess_call_wrapper",
)
"""``megatron.training.pretrain``'s parameters at core_v0.16.1."""


class UnsupportedMegatronLM(RuntimeError):
    """The Megatron-LM checkout is not a release the project supports."""


def check_pretrain_signature(pretrain) -> None:
    """Raise :class:`UnsupportedMegatronLM` unless ``pretrain`` has the core_v0.16.x signature."""
    found = tuple(inspect.signature(pretrain).parameters)
    if found != PRETRAIN_PARAMETERS:
        missing = [p for p in PRETRAIN_PARAMETERS if p not in found]
        extra = [p for p in found if p not in PRETRAIN_PARAMETERS]
        raise UnsupportedMegatronLM(
            f"this Megatron-LM checkout's megatron.training.pretrain{inspect.signature(pretrain)} is "
            f"not the one of the supported tags {SUPPORTED_TAGS} (missing {missing}, unknown {extra}). "
            f"Check out a {SUPPORTED_TAGS} tag (git checkout core_v0.16.1)."
        )


def check_checkout() -> None:
    """Import ``megatron.training`` from the checkout on ``sys.path`` and check its release."""
    try:
        from megatron.training import training
    except ImportError as exc:
        raise UnsupportedMegatronLM(
            f"megatron.training cannot be imported ({exc}): put a Megatron-LM {SUPPORTED_TAGS} "
            "checkout on the path (--megatron-lm PATH or MEGATRON_LM_PATH)") from exc
    check_pretrain_signature(training.pretrain)
