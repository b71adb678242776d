"""Forward-only log-prob pass over a planned step's packed THD microbatches.

The same forward as the training step (:func:`.loss_func.forward_microbatch`, through
megatron-core's schedule with ``forward_only=True``) and the same float32 vocab-parallel
log-softmax (:func:`~megatron_pg_agg.core.losses.vocab_parallel_logprobs`), without the backward.
Each microbatch's log-probs are gathered from its logits inside the loss function and the logits
are dropped there: nothing of a microbatch is kept but ``[T]`` floats.

:func:`planned_logprobs` returns them in the microbatches' own layout (position ``j`` of
microbatch ``m`` scores ``labels[j]``), so they can be compared with, or written into, the
microbatches' ``old_logprobs`` without any re-indexing (:func:`with_current_logprobs`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from megatron_pg_agg.core.losses import vocab_parallel_logprobs

from .loss_func import forward_microbatch, run_schedule

__all__ = ["planned_logprobs", "with_current_logprobs"]


def planned_logprobs(model: list, microbatches: list, *, tp_group=None, is_last_stage: bool = True,
                     device: Optional[torch.device] = None, seq_length: Optional[int] = None) -> list:
    """``[T]`` float32 log-probs of each microbatch's labels under the current weights (one tensor
    per microbatch, on the last pipeline stage; an empty list on the others). Positions that score
    nothing hold the log-prob of label 0 (callers mask them, as the loss does). ``seq_length``: the
    pipeline's p2p buffer length (as the training step's schedule gets it), default the longest
    microbatch."""

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        if device is not None:
            mb = mb.to(device)

        def gather_logprobs(output_tensor):
            logprobs, _ = vocab_parallel_logprobs(output_tensor[0], mb.labels[0], tp_group=tp_group)
            # the 3-tuple contract (calculate_per_token_loss): nothing is back-propagated
            zero = torch.zeros((), device=logprobs.device)
            return zero, torch.zeros((), dtype=torch.int, device=logprobs.device), {"logprobs": logprobs.detach()}

        return forward_microbatch(chunk, mb), gather_logprobs

    with torch.no_grad():
        store = run_schedule(model, microbatches, forward_step, forward_only=True, seq_length=seq_length)
    return [report["logprobs"] for report in store] if is_last_stage else []


def with_current_logprobs(microbatches: list, logprobs: list) -> list:
    """The microbatches with ``old_logprobs`` replaced by ``logprobs`` (from :func:`planned_logprobs`)
    at every position that scores a token, 0 elsewhere: the PPO ratio of the next update is then 1
    at the current weights, and its gradient that of ``sum c_t A_t log p_t``."""
    # lp lies where the schedule ran (the device); the microbatches stay where they were planned
    return [replace(mb, old_logprobs=torch.where(
                mb.denominator_mask, lp.to(mb.old_logprobs.device, mb.old_logprobs.dtype),
                torch.zeros_like(mb.old_logprobs)))
            for mb, lp in zip(microbatches, logprobs)]
