"""Rollouts of one optimizer step: per-response records and their columnar (packed) form.

``Rollout`` is the convenient per-response record (lists of Python values). ``RolloutBatch``
holds a whole step as flat host tensors plus lengths: the step planner works on it with vector
operations, so planning a million-token step costs milliseconds, not a Python loop per token.
Both are checked on the host, where the data is built; the training hot path trusts them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_pg_agg.core.segments import exclusive_cumsum, segment_of


LOGPROB_TOLERANCE = 1e-4
"""Largest log-prob accepted at a valid position (``loss_mask`` 1): log p <= 0 up to float noise;
above it is a probability above 1 (a sign or unit mix-up upstream). Masked positions are not checked."""


class PlanError(ValueError):
    """A step that cannot be planned; the message names the rollout and field."""


@dataclass
class Rollout:
    """One response to one prompt, as produced by the rollout engine."""

    prompt_ids: Sequence[int]
    """Prompt token ids."""
    response_ids: Sequence[int]
    """Response token ids (at least one)."""
    loss_mask: Sequence[int]
    """Per response token: 1 if the token is trained on (the denominator mask d)."""
    advantages: Sequence[float]
    """Per response token advantage."""
    old_logprobs: Sequence[float]
    """Per response token log-prob under the behaviour policy."""
    group_id: object
    """Prompt-group identifier: responses to the same prompt share it."""
    ref_logprobs: Optional[Sequence[float]] = None
    """Per response token log-prob under the reference policy (needed for a KL penalty)."""
    numerator_mask: Optional[Sequence[int]] = None
    """Per response token: 0 removes a token from the numerator only (filtering); None = loss_mask."""
    rollout_logprobs: Optional[Sequence[float]] = None
    """Per response token log-prob under the rollout engine's sampler (vLLM, SGLang): needed by a
    rollout-engine correction, which compares it with ``old_logprobs``."""


def _positive_logprob(i: int, name: str, j: int, value: float) -> str:
    return (f"rollout {i}: {name}[{j}]={float(value):.6g} at valid position {j} is above 0 (a probability above 1); "
            f"expected a log-probability <= 0 (up to {LOGPROB_TOLERANCE:g} is allowed as float noise)")


def check_rollout(i: int, r: Rollout, vocab_size: Optional[int]) -> None:
    """Per-field checks of one record, with messages naming the rollout, field and position."""
    resp = len(r.response_ids)
    if resp == 0:
        raise PlanError(f"rollout {i}: response_ids is empty (a response needs at least one token)")
    for name in ("loss_mask", "advantages", "old_logprobs", "ref_logprobs", "numerator_mask", "rollout_logprobs"):
        values = getattr(r, name)
        if values is not None and len(values) != resp:
            raise PlanError(f"rollout {i}: {name} has {len(values)} entries but response_ids has {resp}")
    if len(r.prompt_ids) == 0:
        raise PlanError(f"rollout {i}: prompt_ids is empty (the first response token needs a prompt position)")
    if vocab_size is not None:
        for name in ("prompt_ids", "response_ids"):
            for j, tok in enumerate(getattr(r, name)):
                if not 0 <= tok < vocab_size:
                    raise PlanError(f"rollout {i}: {name}[{j}]={tok} is outside the vocabulary [0, {vocab_size})")
    for j, (m, a, lp) in enumerate(zip(r.loss_mask, r.advantages, r.old_logprobs)):
        if m not in (0, 1, True, False):
            raise PlanError(f"rollout {i}: loss_mask[{j}]={m!r} must be 0 or 1")
        if m and not (math.isfinite(a) and math.isfinite(lp)):
            raise PlanError(f"rollout {i}: non-finite advantages/old_logprobs at valid position {j}")
        if m and lp > LOGPROB_TOLERANCE:
            raise PlanError(_positive_logprob(i, "old_logprobs", j, lp))
        for name in ("ref_logprobs", "rollout_logprobs"):
            values = getattr(r, name)
            if m and values is not None and not math.isfinite(values[j]):
                raise PlanError(f"rollout {i}: non-finite {name} at valid position {j}")
            if m and values is not None and values[j] > LOGPROB_TOLERANCE:
                raise PlanError(_positive_logprob(i, name, j, values[j]))
    if r.numerator_mask is not None:
        for j, (n, m) in enumerate(zip(r.numerator_mask, r.loss_mask)):
            if n and not m:
                raise PlanError(f"rollout {i}: numerator_mask[{j}] is 1 where loss_mask is 0")


@dataclass
class RolloutBatch:
    """A step's rollouts as flat host tensors (response fields concatenated in rollout order)."""

    prompt_lengths: torch.Tensor
    """int64 ``[N]``: prompt tokens per rollout."""
    response_lengths: torch.Tensor
    """int64 ``[N]``: response tokens per rollout."""
    prompt_tokens: torch.Tensor
    """int64 ``[sum P]``: every prompt, concatenated."""
    response_tokens: torch.Tensor
    """int64 ``[sum R]``: every response, concatenated."""
    loss_mask: torch.Tensor
    """bool ``[sum R]``: the denominator mask d."""
    advantages: torch.Tensor
    """float32 ``[sum R]``."""
    old_logprobs: torch.Tensor
    """float32 ``[sum R]``."""
    group_index: torch.Tensor
    """int64 ``[N]``: prompt group of each rollout (any integers; equal = same group)."""
    ref_logprobs: Optional[torch.Tensor] = None
    """float32 ``[sum R]`` or None."""
    numerator_mask: Optional[torch.Tensor] = None
    """bool ``[sum R]`` (filtering; within loss_mask) or None for no filtering."""
    rollout_logprobs: Optional[torch.Tensor] = None
    """float32 ``[sum R]`` (the rollout engine's log-probs) or None."""
    group_labels: Optional[list] = None
    """The original group ids, indexed by ``group_index`` (for messages); optional."""

    def __len__(self) -> int:
        return self.prompt_lengths.numel()

    @staticmethod
    def from_rollouts(rollouts: Sequence[Rollout], *, vocab_size: Optional[int] = None) -> "RolloutBatch":
        """Check each record (messages name rollout, field, position) and pack them."""
        for i, r in enumerate(rollouts):
            check_rollout(i, r, vocab_size)
        labels, index = [], {}
        for r in rollouts:
            if r.group_id not in index:
                index[r.group_id] = len(labels)
                labels.append(r.group_id)
        with_ref = all(r.ref_logprobs is not None for r in rollouts)
        with_rollout = all(r.rollout_logprobs is not None for r in rollouts)
        with_num = any(r.numerator_mask is not None for r in rollouts)

        def flat(values, dtype):
            out = [v for vs in values for v in vs]
            return torch.tensor(out, dtype=dtype) if out else torch.zeros(0, dtype=dtype)

        loss_mask = flat((r.loss_mask for r in rollouts), torch.bool)
        return RolloutBatch(
            prompt_lengths=torch.tensor([len(r.prompt_ids) for r in rollouts], dtype=torch.long),
            response_lengths=torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.long),
            prompt_tokens=flat((r.prompt_ids for r in rollouts), torch.long),
            response_tokens=flat((r.response_ids for r in rollouts), torch.long),
            loss_mask=loss_mask,
            advantages=flat((r.advantages for r in rollouts), torch.float32),
            old_logprobs=flat((r.old_logprobs for r in rollouts), torch.float32),
            group_index=torch.tensor([index[r.group_id] for r in rollouts], dtype=torch.long),
            ref_logprobs=flat((r.ref_logprobs for r in rollouts), torch.float32) if with_ref else None,
            rollout_logprobs=(flat((r.rollout_logprobs for r in rollouts), torch.float32)
                              if with_rollout else None),
            numerator_mask=(flat((r.numerator_mask if r.numerator_mask is not None else r.loss_mask
                                  for r in rollouts), torch.bool) & loss_mask) if with_num else None,
            group_labels=labels,
        )

    def validate(self, *, vocab_size: Optional[int] = None) -> None:
        """Vectorised checks of a batch built elsewhere (first offender named)."""
        n = len(self)
        if n == 0:
            raise PlanError("the step has no rollouts")
        for name in ("prompt_lengths", "response_lengths"):
            bad = getattr(self, name) < 1
            if bool(bad.any()):
                i = int(bad.int().argmax())
                raise PlanError(f"rollout {i}: {name}[{i}] is {int(getattr(self, name)[i])}; at least one token is needed")
        p_total, r_total = int(self.prompt_lengths.sum()), int(self.response_lengths.sum())
        if self.prompt_tokens.numel() != p_total:
            raise PlanError(f"prompt_tokens holds {self.prompt_tokens.numel()} ids but prompt_lengths sum to {p_total}")
        for name in ("response_tokens", "loss_mask", "advantages", "old_logprobs", "ref_logprobs",
                     "numerator_mask", "rollout_logprobs"):
            t = getattr(self, name)
            if t is not None and t.numel() != r_total:
                raise PlanError(f"{name} holds {t.numel()} entries but response_lengths sum to {r_total}")
        if self.group_index.numel() != n:
            raise PlanError(f"group_index holds {self.group_index.numel()} entries for {n} rollouts")
        starts = exclusive_cumsum(self.response_lengths)

        def owner(flat_index: int) -> tuple[int, int]:
            i = int(segment_of(starts, torch.tensor(flat_index)))
            return i, flat_index - int(starts[i])

        if vocab_size is not None:
            for name, tokens, lengths in (("prompt_ids", self.prompt_tokens, self.prompt_lengths),
                                          ("response_ids", self.response_tokens, self.response_lengths)):
                bad = (tokens < 0) | (tokens >= vocab_size)
                if bool(bad.any()):
                    k = int(bad.int().argmax())
                    ps = exclusive_cumsum(lengths)
                    i = int(segment_of(ps, torch.tensor(k)))
                    raise PlanError(f"rollout {i}: {name}[{k - int(ps[i])}]={int(tokens[k])} is outside the "
                                    f"vocabulary [0, {vocab_size})")
        valid = self.loss_mask
        for name in ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs"):
            t = getattr(self, name)
            if t is not None:
                bad = valid & ((t - t) != 0)  # x - x is NaN exactly when x is NaN or +-inf
                if bool(bad.any()):
                    i, j = owner(int(bad.int().argmax()))
                    raise PlanError(f"rollout {i}: non-finite {name} at valid position {j}")
        for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
            t = getattr(self, name)
            if t is not None:
                bad = valid & (t > LOGPROB_TOLERANCE)
                if bool(bad.any()):
                    k = int(bad.int().argmax())
                    i, j = owner(k)
                    raise PlanError(_positive_logprob(i, name, j, float(t[k])))
        if self.numerator_mask is not None:
            bad = self.numerator_mask & ~valid
            if bool(bad.any()):
                i, j = owner(int(bad.int().argmax()))
                raise PlanError(f"rollout {i}: numerator_mask[{j}] is 1 where loss_mask is 0")
