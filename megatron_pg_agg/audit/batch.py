"""The audit's synthetic rollout: one collection shaped like a host's config, no model.

Rows are group-major (``group_size`` consecutive responses per prompt, ``prompts`` groups). What the
batch holds is what makes a loss aggregation show its split dependence:

* response lengths from ``max_response / 8`` to ``max_response`` (the longest at the maximum), so
  micro-batches get different padded widths and token counts;
* one fully masked response every ``MASKED_EVERY`` rows and a hole of masked tokens in each long one;
* group-normalised rewards, so advantages of both signs;
* old log-probs that differ from the current ones by enough noise that PPO's clip is active on a
  share of the tokens.

The current log-probs are the leaves the objective is differentiated by: ``dJ / d logp_t`` is the
weight the objective gives token ``t`` (the host's step back-propagates exactly that into the model).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AuditBatch", "BatchShape", "synthetic_batch"]

MASKED_EVERY = 7
"""Row ``i`` with ``i % MASKED_EVERY == 1`` has no valid token (a removed or truncated response)."""
OLD_NOISE = 0.3
"""Standard deviation of ``old - current`` log-probs: about half of the tokens fall outside a 0.2 clip."""


@dataclass(frozen=True)
class BatchShape:
    """The shape of one rollout collection, read from a host's config."""

    group_size: int
    """Responses per prompt (verl ``rollout.n``, slime ``--n-samples-per-prompt``, ``--grpo-group-size``)."""
    prompts: int
    """Prompt groups in one collection (prompts per step of the rollout)."""
    max_response: int
    """The longest response the config allows, in tokens."""
    seed: int = 0
    """The generator's seed: the same seed gives the same batch."""

    def __post_init__(self):
        for name in ("group_size", "prompts", "max_response"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: the audit's batch needs a positive integer")

    @property
    def rows(self) -> int:
        return self.group_size * self.prompts


@dataclass(frozen=True)
class AuditBatch:
    """One collection, row after row (group-major). Every per-token list holds one 1-D tensor per row."""

    lengths: list
    """Response length of each row (tokens)."""
    masks: list
    """bool [length] per row: the loss mask (False on holes and on fully masked rows)."""
    advantages: torch.Tensor
    """float32 [rows]: the row's advantage (group-normalised reward)."""
    logprobs: list
    """float32 [length] per row: the current policy's log-probs (the differentiated leaves)."""
    old_logprobs: list
    """float32 [length] per row: the behaviour policy's log-probs."""
    ref_logprobs: list
    """float32 [length] per row: the reference policy's log-probs (KL terms)."""
    group_ids: list
    """The prompt group of each row."""

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def valid_tokens(self) -> int:
        return int(sum(int(m.sum()) for m in self.masks))


def _lengths(shape: BatchShape, gen: torch.Generator) -> list:
    low = max(1, shape.max_response // 8)
    lengths = torch.randint(low, shape.max_response + 1, (shape.rows,), generator=gen).tolist()
    lengths[0] = shape.max_response
    if shape.rows > 2:
        lengths[2] = low
    return lengths


def _masks(lengths: list) -> list:
    masks = []
    for i, n in enumerate(lengths):
        mask = torch.ones(n, dtype=torch.bool)
        if i % MASKED_EVERY == 1:
            mask[:] = False
        elif n >= 8:
            mask[n // 3: n // 3 + max(1, n // 16)] = False  # a hole: tool output, a truncated span
        masks.append(mask)
    return masks


def _advantages(shape: BatchShape, gen: torch.Generator) -> torch.Tensor:
    rewards = torch.rand(shape.prompts, shape.group_size, generator=gen, dtype=torch.float64)
    if shape.group_size == 1:
        return (rewards.reshape(-1) - 0.5).float()
    centred = rewards - rewards.mean(1, keepdim=True)
    return (centred / (rewards.std(1, keepdim=True) + 1e-6)).reshape(-1).float()


def synthetic_batch(shape: BatchShape) -> AuditBatch:
    """The audit's batch for ``shape`` (module docstring); deterministic in ``shape.seed``."""
    gen = torch.Generator().manual_seed(shape.seed)
    lengths = _lengths(shape, gen)
    logprobs = [-torch.rand(n, generator=gen) * 2.0 - 0.05 for n in lengths]
    old = [lp + OLD_NOISE * torch.randn(lp.shape, generator=gen) for lp in logprobs]
    ref = [lp + 0.1 * torch.randn(lp.shape, generator=gen) for lp in logprobs]
    groups = [i // shape.group_size for i in range(shape.rows)]
    return AuditBatch(lengths, _masks(lengths), _advantages(shape, gen), logprobs, old, ref, groups)
