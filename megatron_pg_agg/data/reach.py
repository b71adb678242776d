"""The "reach" task: a verifiable task on which a response can be seen to fail part-way.

A prompt names a target ``T`` (``min_target..max_target``). The response climbs from 0 towards it
in steps of +1, +2 or +3, writing the **running total** after every step, and ends with EOS::

    prompt   <bos> 11
    response 2 5 6 9 11 <eos>           reward 1 (ends exactly on the target)
    response 3 6 9 12 <eos>             reward 0 (overshot: 12 > 11)
    response 3 6 9 12 13 15 16 <eos>    reward 0 (overshot, and kept going)

The verifier (:meth:`ReachTask.reward`) gives 1 exactly when every step is +1, +2 or +3, EOS comes
within ``max_response_tokens`` tokens (EOS counted), and the last total equals ``T``; else 0. Once
a total passes ``T`` the response cannot be correct any more, while the policy may still go on
writing: that is what lets GRPO's per-response normalisation lengthen wrong answers (Liu et al.
2025, "Understanding R1-Zero-Like Training", Sec. 3; docs/length-bias.md).

Why running totals rather than the step sizes themselves (the variant the issue describes): the
state that decides what is correct, "how far am I", is then the last token, which a two-layer
transformer reads off directly; with step tokens it would have to add up its whole response first.
The incentive structure (fail part-way, keep writing) is the same.

The warm start (:meth:`ReachTask.demonstration`) is a supervised warm-up on noisy demonstrations:
uniform random steps below the target, EOS on the target with probability ``stop_on_target``,
and after an overshoot one more step with probability ``continue_after_overshoot`` per token (else
EOS). Its accuracy is about 25%, and it already writes past an overshoot, as an LLM that does not
check its own answer does.

Token ids: 0 unused (padding), 1 BOS, 2 EOS, ``3 + v`` the number ``v`` (targets and totals).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

__all__ = ["BOS", "EOS", "ReachTask"]

BOS = 1
EOS = 2
_FIRST_NUMBER = 3


@dataclass(frozen=True)
class ReachTask:
    """The reach task's sizes and its warm-up demonstrations (checks in ``__post_init__``)."""

    min_target: int = 5
    """Smallest target."""
    max_target: int = 24
    """Largest target."""
    max_response_tokens: int = 32
    """Longest response, EOS included: a response that has not ended by then is truncated (reward 0)."""
    max_step: int = 3
    """Steps are +1 .. +max_step."""
    stop_on_target: float = 0.5
    """Demonstrations: probability of EOS when the total equals the target (else one more step)."""
    continue_after_overshoot: float = 0.7
    """Demonstrations: per token after an overshoot, probability of one more step (else EOS)."""

    def __post_init__(self):
        if not 1 <= self.min_target <= self.max_target:
            raise ValueError(f"targets {self.min_target}..{self.max_target}: need 1 <= min_target <= max_target")
        if self.max_step < 1 or self.max_response_tokens < 2:
            raise ValueError("need max_step >= 1 and max_response_tokens >= 2")
        for name in ("stop_on_target", "continue_after_overshoot"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} is not a probability")

    @property
    def largest_number(self) -> int:
        """The largest total a response can write (every step +max_step)."""
        return max(self.max_target, self.max_step * self.max_response_tokens)

    @property
    def vocab_size(self) -> int:
        """Token ids used: padding, BOS, EOS and the numbers 0..largest_number."""
        return _FIRST_NUMBER + self.largest_number + 1

    @property
    def prompt_tokens(self) -> int:
        """Every prompt is ``<bos> T``."""
        return 2

    @staticmethod
    def number(value: int) -> int:
        """The token id of the number ``value``."""
        return _FIRST_NUMBER + value

    def prompt(self, target: int) -> list:
        """``[<bos>, T]``."""
        return [BOS, self.number(target)]

    def targets(self, count: int, rng: random.Random) -> list:
        """``count`` targets drawn uniformly from ``min_target..max_target``."""
        return [rng.randint(self.min_target, self.max_target) for _ in range(count)]

    def reward(self, target: int, response: list) -> float:
        """1.0 when the response is a valid climb that ends with EOS exactly on ``target``, else 0.0."""
        if not response or response[-1] != EOS or len(response) > self.max_response_tokens:
            return 0.0
        total = 0
        for token in response[:-1]:
            step = token - _FIRST_NUMBER - total
            if not 1 <= step <= self.max_step:
                return 0.0
            total += step
        return 1.0 if total == target else 0.0

    def demonstration(self, target: int, rng: random.Random) -> list:
        """One noisy demonstration for ``target`` (see the module docstring), EOS included unless
        truncated at ``max_response_tokens``."""
        response, total = [], 0
        while len(response) < self.max_response_tokens:
            if total == target and rng.random() < self.stop_on_target:
                break
            if total > target and rng.random() >= self.continue_after_overshoot:
                break
            total += rng.randint(1, self.max_step)
            response.append(self.number(total))
        if len(response) < self.max_response_tokens:
            response.append(EOS)
        return response

    def scores(self, targets: list, responses: list) -> torch.Tensor:
        """float32 ``[N]`` rewards of ``responses[i]`` for ``targets[i]``."""
        return torch.tensor([self.reward(t, r) for t, r in zip(targets, responses)], dtype=torch.float32)
