"""Sampling responses from the live policy with the model's own forward pass.

The policy is the trainer's megatron-core GPT, in the state the last optimizer step left it. Each
new token is drawn at temperature 1 from the full softmax of the last position's logits, and its
log-probability under that softmax is recorded as the behaviour log-prob (``old_logprobs`` of the
rollout). The trainer later scores the same tokens on packed THD microbatches; both compute
``log softmax`` of the same network on the same prefix, so the two agree to float tolerance
(tests/distributed/test_grpo_reach.py checks it token by token).

There is no KV cache: each of the (at most ``max_new_tokens``) steps runs the whole prefix of
the rows that have not ended yet, ``[rows, t]`` with a causal mask. For the tiny models this is
written for, that costs less than the bookkeeping of a cache. Sampling is a host-driven loop (one
host read per new token, to drop the rows that ended); it is not the training step's hot path.

Layout: the model is one pipeline stage (PP = 1) and unsharded logits (TP = 1), CP = 1; the
online entry refuses other layouts at start-up. Every DP rank samples its own prompts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Samples", "sample_responses"]


@dataclass(frozen=True)
class Samples:
    """Responses drawn for a batch of prompts (host tensors)."""

    tokens: torch.Tensor
    """int64 ``[B, max_new_tokens]``: the drawn tokens; positions at and after ``lengths[i]`` are padding."""
    logprobs: torch.Tensor
    """float32 ``[B, max_new_tokens]``: log-prob of each drawn token under the sampling policy."""
    lengths: torch.Tensor
    """int64 ``[B]``: response length, EOS included when one was drawn."""
    ended: torch.Tensor
    """bool ``[B]``: an EOS was drawn (False: truncated at ``max_new_tokens``)."""

    def response(self, i: int) -> list:
        """Response ``i`` as a list of token ids."""
        return self.tokens[i, : int(self.lengths[i])].tolist()

    def response_logprobs(self, i: int) -> list:
        """Behaviour log-probs of response ``i``."""
        return self.logprobs[i, : int(self.lengths[i])].tolist()


@torch.no_grad()
def sample_responses(model, prompts: torch.Tensor, *, max_new_tokens: int, eos: int,
                     generator: torch.Generator) -> Samples:
    """Draw one response per row of ``prompts`` (int64 ``[B, P]``, all prompts of one length) from
    ``model`` (one megatron-core GPT chunk, DDP-wrapped or not), at temperature 1.

    ``generator``: the CPU generator every draw uses (seeded by the caller: the same seed, weights
    and prompts give the same responses). A row stops at its first EOS (later positions stay 0);
    the loop stops when every row has stopped or after ``max_new_tokens`` tokens."""
    batch, prompt_len = prompts.shape
    device = next(model.parameters()).device
    tokens = prompts.to(device)
    drawn = torch.zeros(batch, max_new_tokens, dtype=torch.long)
    logprobs = torch.zeros(batch, max_new_tokens, dtype=torch.float32)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long)
    ended = torch.zeros(batch, dtype=torch.bool)
    active = torch.arange(batch)  # rows still writing: only they run the next forward
    was_training = model.training
    model.eval()
    try:
        for t in range(max_new_tokens):
            length = prompt_len + t
            rows = tokens.shape[0]
            positions = torch.arange(length, device=device).expand(rows, length)
            logits = model(input_ids=tokens, position_ids=positions, attention_mask=None)  # [rows, t, V]
            # the trainer's log-probs are float32 log-softmax of the same logits
            step_logprobs = torch.log_softmax(logits[:, -1, :].float(), dim=-1).cpu()
            choice = torch.multinomial(step_logprobs.exp(), 1, generator=generator).squeeze(1)
            drawn[active, t] = choice
            logprobs[active, t] = step_logprobs.gather(1, choice.unsqueeze(1)).squeeze(1)
            stop = choice == eos
            lengths[active[stop]] = t + 1
            ended[active[stop]] = True
            going = (~stop).nonzero().squeeze(1)  # host-driven loop: this read is the per-token sync
            if going.numel() == 0:
                break
            active = active[going]
            tokens = torch.cat([tokens.index_select(0, going.to(device)),
                                choice.index_select(0, going).unsqueeze(1).to(device)], dim=1)
    finally:
        model.train(was_training)
    return Samples(tokens=drawn, logprobs=logprobs, lengths=lengths, ended=ended)
