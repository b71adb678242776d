"""NeMo-RL's GRPO loss under the project's modes, written from the formulas (NeMo-RL's docs and the
``ClippedPGLossFn`` docstring, the README's contract), float64, one response at a time; and random
NeMo-RL training batches. Shares no code with the plug-in or with NeMo-RL's loss.

Per response ``i`` of an optimizer step and response position ``t`` (NeMo-RL's ``[:, 1:]``
columns): ``tm`` = token_mask, ``s_i`` = sample_mask, ``v = tm s`` (valid), ``n`` = v on the rows
the filtered numerator keeps. ``x_t = lp_t - prev_t``.

* ratio ``r_t``: ``exp(x_t)``; GSPO (``sequence_level_importance_ratios``) ``exp(sum_t tm x_t / M_i)``
  (its gradient included); ``force_on_policy_ratio`` ``exp(lp - sg(lp))``; ``disable_ppo_ratio`` ``lp``.
* token loss: ``max(-A r, -A clip(r, 1 - lo, 1 + hi))`` (dual clip: for ``A < 0`` at most ``-A c``);
  CISPO ``-A sg(clip(r)) lp``; ``disable_ppo_ratio``: ``-A lp``.
* importance weight (``use_importance_sampling_correction``): ``exp(prev - gen)`` per token, or per
  sequence ``exp(sum_t v (prev - gen))`` (GSPO); ``tis`` clamps it to ``[min or 0, max]``,
  ``icepop`` zeroes it outside ``[min, max]``, ``seq-mask-tis`` zeroes the sequences whose
  ``exp(mean_tm (prev - gen))`` lies outside ``[min, max]``.
* ``pg_t = w_t * loss_t``; the PG term is the mode's ``(1/W) sum_t c_t n_t pg_t``
  (:func:`tests.support.reference.reference_objective`, the project's own slow reference).
* KL (``reference_policy_kl_penalty`` beta > 0): ``kl_t = sg-weighted k(lp, ref)``: ``k1 = lp - ref``,
  ``k2 = (ref - lp)^2 / 2``, ``k3 = exp(ref - lp) - 1 - (ref - lp)``, times ``exp(lp - sg(lp))``
  (value 1: the score-function term of an on-policy KL); token level ``beta sum v kl / G``,
  sequence level ``beta sum_i s_i (sum_t tm kl / M_i) / S``.
* VAPO's positive-example NLL (weight mu): ``mu sum_{v, reward > 0} (-lp) / C``, a token mean over
  the step's correct tokens.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Optional

import torch

from tests.support.reference import reference_objective


@dataclass
class Options:
    """The ``ClippedPGLossConfig`` numbers the reference reads (a name, and the config's keys)."""

    name: str = "ppo"
    keys: dict = field(default_factory=dict)

    def get(self, key, default=None):
        return self.keys.get(key, default)


DEFAULTS = dict(ratio_clip_min=0.2, ratio_clip_max=0.2, ratio_clip_c=None, reference_policy_kl_penalty=0.0,
                reference_policy_kl_type="k3", token_level_loss=True, sequence_level_importance_ratios=False,
                use_importance_sampling_correction=False, truncated_importance_sampling_type=None,
                truncated_importance_sampling_ratio=None, truncated_importance_sampling_ratio_min=None,
                disable_ppo_ratio=False, force_on_policy_ratio=False, use_cispo=False,
                positive_example_nll_weight=0.0)


def random_batch(rng: random.Random, *, groups: int = 4, max_group: int = 4, group_size: Optional[int] = None,
                 prompt_len=(2, 5), response_len=(1, 7), empty_response: bool = True,
                 dtype: torch.dtype = torch.float64) -> dict:
    """A NeMo-RL training batch (``train_data`` of ``grpo_train``, CPU): ``groups`` prompts, each with
    ``group_size`` (or 1..max_group) responses in consecutive rows sharing the prompt's tokens; holes
    in the token mask (a response's first token among them), generation log-probs on the response
    tokens only (NeMo-RL's 0 elsewhere), a row with sample_mask 0, optionally an empty response (sample_mask 1, no loss
    token); GRPO-like advantages (one value per response); log-probs near each other."""
    sizes = [group_size or rng.randint(1, max_group) for _ in range(groups)]
    rows = []
    for g, size in enumerate(sizes):
        prompt = [rng.randrange(3, 50) for _ in range(rng.randint(*prompt_len))]
        for _ in range(size):
            rows.append((g, prompt, rng.randint(*response_len)))
    width = max(len(p) + n for _, p, n in rows) + 1
    count = len(rows)
    input_ids = torch.zeros(count, width, dtype=torch.long)
    token_mask = torch.zeros(count, width)
    lengths = torch.zeros(count, dtype=torch.long)
    generated = torch.zeros(count, width, dtype=torch.bool)
    for i, (_, prompt, n) in enumerate(rows):
        ids = prompt + [rng.randrange(3, 50) for _ in range(n)]
        input_ids[i, :len(ids)] = torch.tensor(ids)
        lengths[i] = len(ids)
        generated[i, len(prompt):len(ids)] = True
        for t in range(len(prompt), len(ids)):
            token_mask[i, t] = float(rng.random() > 0.15)
        if not token_mask[i].any():
            token_mask[i, len(prompt)] = 1.0
    sample_mask = torch.ones(count)
    sample_mask[rng.randrange(count)] = 0.0
    if empty_response and count > 2:
        spare = [i for i in range(count) if sample_mask[i] > 0]
        token_mask[rng.choice(spare)] = 0.0
    advantages = torch.tensor([[rng.uniform(-1.5, 1.5)] for _ in range(count)]).expand(count, width).clone()
    # NeMo-RL's generation log-probs: the generated tokens' (masked ones included), 0 on every other token
    gen = torch.tensor([[-rng.uniform(0.3, 3.0) for _ in range(width)] for _ in range(count)]) * generated
    prev = gen + torch.tensor([[rng.uniform(-0.05, 0.05) for _ in range(width)] for _ in range(count)])
    ref = prev + torch.tensor([[rng.uniform(-0.3, 0.3) for _ in range(width)] for _ in range(count)])
    rewards = torch.tensor([float(rng.random() > 0.5) for _ in rows])
    floats = dict(token_mask=token_mask, sample_mask=sample_mask, advantages=advantages, prev_logprobs=prev,
                  generation_logprobs=gen, reference_policy_logprobs=ref, rewards=rewards)
    return dict(input_ids=input_ids, input_lengths=lengths, **{k: v.to(dtype) for k, v in floats.items()},
                group_of_row=[g for g, _, _ in rows])


def _ratio_and_loss(lp, prev, adv, tm, o: Options):
    """``(ratio, token loss)`` of one response (module docstring)."""
    lo, hi, c = o.get("ratio_clip_min"), o.get("ratio_clip_max"), o.get("ratio_clip_c")
    if o.get("disable_ppo_ratio"):
        return lp, -adv * lp
    if o.get("force_on_policy_ratio"):
        ratio = torch.exp(lp - lp.detach())
    elif o.get("sequence_level_importance_ratios"):
        m = float(tm.sum())
        ratio = torch.exp(((lp - prev) * tm).sum() / m).expand_as(lp) if m else torch.ones_like(lp)
    else:
        ratio = torch.exp(lp - prev)
    clipped = ratio.clamp(1 - lo, 1 + hi)
    if o.get("use_cispo"):
        return ratio, -adv * clipped.detach() * lp
    loss = torch.maximum(-adv * ratio, -adv * clipped)
    if c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * c), loss)
    return ratio, loss


def _importance_weight(prev, gen, tm, v, o: Options):
    if not o.get("use_importance_sampling_correction"):
        return torch.ones_like(prev)
    if o.get("sequence_level_importance_ratios"):
        weight = torch.exp(((prev - gen) * v).sum()).expand_as(prev)
    else:
        weight = torch.exp(prev - gen)
    kind, top, low = (o.get("truncated_importance_sampling_type"), o.get("truncated_importance_sampling_ratio"),
                      o.get("truncated_importance_sampling_ratio_min"))
    if kind == "tis":
        weight = weight.clamp(low or 0.0, top)
    elif kind == "icepop":
        weight = torch.where((weight >= low) & (weight <= top), weight, 0.0)
    elif kind == "seq-mask-tis":
        m = float(tm.sum())
        geo = math.exp(float(((prev - gen) * tm).sum()) / m) if m else 1.0
        weight = weight * float(low <= geo <= top)
    return weight


def _kl(lp, ref, kind: str):
    logr = ref - lp
    value = {"k1": -logr, "k2": logr * logr / 2, "k3": torch.exp(logr) - 1 - logr}[kind]
    return value * torch.exp(lp - lp.detach())


def reference_step(lp: torch.Tensor, batch: dict, rows: list, o: Options, *, mode: str,
                   divisor: Optional[float] = None, kept_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """J of the optimizer step made of ``rows`` (module docstring), a float64 0-d tensor
    differentiable in ``lp`` (float64 ``[B, T-1]``, NeMo-RL's next-token log-probs)."""
    zero = lp.new_zeros(())
    pg, num, den = [], [], []
    kl_tok = kl_seq = nll = zero
    tokens = seqs = correct = 0
    order = sorted(rows, key=lambda i: (batch["group_of_row"][i], i))  # groups consecutive
    for i in order:
        tm = batch["token_mask"][i, 1:].double()
        s = float(batch["sample_mask"][i])
        v = tm * s
        keep = 1.0 if kept_rows is None else float(kept_rows[i])
        prev, gen = batch["prev_logprobs"][i, 1:].double(), batch["generation_logprobs"][i, 1:].double()
        adv = batch["advantages"][i, 1:].double()
        _, loss = _ratio_and_loss(lp[i], prev, adv, tm, o)
        pg.append(_importance_weight(prev, gen, tm, v, o) * loss)
        num.append((v * keep) > 0)
        den.append(v > 0)
        tokens += int(v.sum())
        seqs += int(s)
        beta = o.get("reference_policy_kl_penalty")
        if beta:
            ref = batch["reference_policy_logprobs"][i, 1:].double()
            kl = beta * _kl(lp[i], ref, o.get("reference_policy_kl_type"))
            kl_tok = kl_tok + (kl * v).sum()
            m = float(tm.sum())
            kl_seq = kl_seq + (s * (kl * tm).sum() / m if m else zero)
        if o.get("positive_example_nll_weight") and float(batch["rewards"][i]) > 0:
            nll = nll + (-lp[i] * v).sum()
            correct += int(v.sum())
    width = lp.shape[1]
    group_sizes, last = [], None
    for i in order:
        g = batch["group_of_row"][i]
        if g != last:
            group_sizes.append(0)
            last = g
        group_sizes[-1] += 1
    objective, _ = reference_objective(torch.cat(pg), torch.cat(num), torch.cat(den), [width] * len(order),
                                       group_sizes, mode, divisor)
    if o.get("reference_policy_kl_penalty"):
        objective = objective + ((kl_tok / tokens if tokens else zero) if o.get("token_level_loss")
                                 else (kl_seq / seqs if seqs else zero))
    if o.get("positive_example_nll_weight") and correct:
        objective = objective + o.get("positive_example_nll_weight") * nll / correct
    return objective
