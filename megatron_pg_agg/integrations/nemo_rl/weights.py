r"""The per-token fields that make NeMo-RL's own ``ClippedPGLossFn`` exact in every mode (host side,
no NeMo-RL import).

NeMo-RL (``Policy.train``, Megatron worker) trains one optimizer step on each contiguous chunk of
``gbs`` rows of the driver's batch (``policy.train_global_batch_size``; ``shard_by_batch_size``
then splits a chunk over the DP ranks, and each rank into micro-batches: fixed ``mbs``, dynamic
batching or sequence packing). With ``m_t = token_mask[:, 1:] * sample_mask`` its loss makes the
step's gradient that of

    token level:     J_nemo = sum_t m_t pg_t(A_t) / G          G = sum_t m_t        (global_valid_toks)
    sequence level:  J_nemo = sum_i s_i (1/M_i) sum_t tm_t pg_t(A_t) / S
                                                        M_i = sum_t token_mask[i, 1:], S = sum_i s_i

whatever the split (``process_global_batch`` all-reduces ``G`` and ``S`` over DP once per step; the
schedule's factors cancel in ``LossPostProcessor``; the split path divides by ``G`` or ``S`` at
``finish_train_step``). Every policy loss ``ClippedPGLossFn`` offers (PPO clip, dual clip, CISPO,
GSPO's sequence ratio, REINFORCE without a ratio, with or without the importance-sampling
correction) is positively homogeneous in the advantage, token by token: ``pg_t(k A) = k pg_t(A)``
for ``k >= 0``. The project's objective is ``J = (1/W) sum_t c_t pg_t`` with ``c_t`` and ``W`` from
:func:`~megatron_pg_agg.core.aggregation.token_weights` over the step (through
:func:`~megatron_pg_agg.integrations.step_weights.dp_step_weights`, the call every entry shares),
numerator = denominator = ``m`` (less the plug-in's filtered rows). So NeMo-RL's loss is handed

    A'_t = A_t k_t,    k_t = c_t G / W   (token level)    or    c_t M_i S / W   (sequence level)

(:data:`ADVANTAGE_SCALE`, token-aligned like ``token_mask``: it travels with its row through
sharding, dynamic batching and packing), and ``J_nemo = J`` exactly. The step counts ``S`` and
``G`` travel per row too (:data:`STEP_SEQUENCES`, :data:`STEP_TOKENS`): the loss needs them on the
split path, where NeMo-RL hands it placeholders (:mod:`.loss`).

Host tensors, once per ``Policy.train`` call on the driver; nothing here runs per micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_pg_agg.core.modes import PROMPT_MEAN
from megatron_pg_agg.integrations.objective import HostObjective
from megatron_pg_agg.integrations.step_weights import cut_groups, dp_step_weights

__all__ = ["ADVANTAGE_SCALE", "STEP_SEQUENCES", "STEP_TOKENS", "NLL_SCALE", "PROMPT_ID", "NemoRLBatchError",
           "NemoRLSettings", "batch_prompt_groups", "prompt_groups", "step_fields"]

ADVANTAGE_SCALE = "pg_agg_advantage_scale"
"""``[B, T]`` in the advantages' dtype (float32 in NeMo-RL's GRPO), aligned with ``token_mask`` (column 0
unused): ``k_t`` (module docstring)."""
STEP_SEQUENCES = "pg_agg_step_sequences"
"""``[B]``: ``S`` of the row's optimizer step (NeMo-RL's ``global_valid_seqs``)."""
STEP_TOKENS = "pg_agg_step_tokens"
"""``[B]``: ``G`` of the row's optimizer step (NeMo-RL's ``global_valid_toks``)."""
NLL_SCALE = "pg_agg_nll_scale"
"""``[B, T]``, aligned with ``token_mask``: ``G / C`` on the valid tokens of rows with a
positive reward (``C`` of them in the step), 0 elsewhere: VAPO's positive-example NLL as a token
mean over the step's correct tokens (NeMo-RL divides by each micro-batch's own count, its #3791)."""


class NemoRLBatchError(ValueError):
    """A batch the configured objective cannot be computed on (names NeMo-RL's keys)."""


@dataclass(frozen=True)
class NemoRLSettings:
    """What the plug-in trains on NeMo-RL: NeMo-RL's ``loss_fn.pg_agg`` block."""

    objective: HostObjective
    """``loss_fn.pg_agg.mode`` and ``loss_fn.pg_agg.divisor``."""
    seq_logprob_error_threshold: Optional[float] = None
    """The filtered numerator: sequences NeMo-RL's own ``compute_and_apply_seq_logprob_error_masking``
    rejects at this threshold leave the numerator and keep their place in the denominator (instead of
    ``grpo.seq_logprob_error_threshold``, which removes them from both); None: off."""

    def __post_init__(self) -> None:
        threshold = self.seq_logprob_error_threshold
        if threshold is not None and not (isinstance(threshold, (int, float)) and threshold > 0):
            raise ValueError(f"seq_logprob_error_threshold must be a positive number or None; got {threshold!r}")


PROMPT_ID = "idx"
"""NeMo-RL's prompt index (``DatumSpec.idx``: one per prompt of the data set, copied to each of its
generations by ``repeat_interleave``). The GRPO batch NeMo-RL 7ea279a hands ``Policy.train`` does not
carry it (``grpo_train`` builds ``train_data`` from ``input_ids``, ``input_lengths``,
``generation_logprobs``, ``token_mask`` and ``sample_mask``); where a batch does, it (with
``task_name``, where carried: each data set numbers its own prompts) names the prompt groups."""


def batch_prompt_groups(data) -> list:
    """One hashable per row of NeMo-RL's training batch ``data``: NeMo-RL's own prompt identity
    (:data:`PROMPT_ID`, with ``task_name``) where the batch carries one, else the prompt read from the
    tokens (:func:`prompt_groups`)."""
    if PROMPT_ID in data:
        ids = data[PROMPT_ID]
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        tasks = list(data["task_name"]) if "task_name" in data else [None] * len(ids)
        return [("prompt", task, ids[i]) for i, task in enumerate(tasks)]
    return prompt_groups(data["input_ids"], data["token_mask"], data.get("generation_logprobs"))


def prompt_groups(input_ids: torch.Tensor, token_mask: torch.Tensor,
                  generation_logprobs: Optional[torch.Tensor] = None) -> list:
    """One hashable per row: its prompt, the tokens before its first response token; rows with the
    same prompt are one group (what NeMo-RL's advantage estimator groups by, ``prompt_ids``). The
    first response token is the first that NeMo-RL trains (``token_mask``) or that has a generation
    log-prob (``generation_logprobs`` non-zero: NeMo-RL gives them to the generated assistant messages
    only, 0 to every other token), so a masked first response token does not make a group of its own.
    A row without a response token gets a group of its own (it adds nothing). Refused
    (:class:`NemoRLBatchError`): generation log-probs on column 0 (not NeMo-RL's layout), and a prompt
    that begins with another row's prompt (:func:`_refuse_nested_prompts`)."""
    response = token_mask.bool()
    if generation_logprobs is not None:
        generated = generation_logprobs != 0
        if bool(generated[:, 0].any()):
            rows = generated[:, 0].nonzero().flatten().tolist()
            raise NemoRLBatchError(
                f"prompt_mean reads each row's prompt up to its first generated token, but generation_logprobs is "
                f"non-zero on column 0 (a prompt token) of rows {_some(rows)}: NeMo-RL gives generation log-probs "
                "to generated tokens only (0 elsewhere); carry NeMo-RL's prompt index in the batch "
                f"({PROMPT_ID!r}, one per row) instead")
        response = response | generated
    has = response.any(1)
    first = torch.argmax(response.to(torch.int8), dim=1)
    rows = []
    for i, (ids, f, h) in enumerate(zip(input_ids.tolist(), first.tolist(), has.tolist())):
        rows.append(tuple(ids[:f]) if h else ("no response token", i))
    _refuse_nested_prompts(rows)
    return rows


def _some(items: list, limit: int = 8) -> str:
    """``items`` as a list of at most ``limit`` entries (the count of the rest after them)."""
    return str(items) if len(items) <= limit else f"{str(items[:limit])[:-1]}, ... ({len(items)} in all)]"


def _refuse_nested_prompts(groups: list) -> None:
    """A row whose prompt begins with another row's prompt is either a response token that NeMo-RL
    neither trains nor gave a generation log-prob (it would make a group of its own) or a prompt
    that begins another (multi-turn history): the tokens cannot tell which, so it is refused."""
    rows_of: dict = {}
    for i, key in enumerate(groups):
        if key and isinstance(key, tuple) and key[0] != "no response token":
            rows_of.setdefault(key, []).append(i)
    ordered = sorted(rows_of)  # a prompt that begins another sorts right before it (or before another that does)
    for short, long in zip(ordered, ordered[1:]):
        if long[:len(short)] == short:
            raise NemoRLBatchError(
                f"prompt_mean: rows {_some(rows_of[long])} have a prompt of {len(long)} tokens (before the first "
                f"trained or generated token) that begins with the {len(short)}-token prompt of rows "
                f"{_some(rows_of[short])}: either response tokens NeMo-RL neither trains nor gave a generation "
                "log-prob, or a prompt that continues another; the tokens cannot tell the groups apart: carry "
                f"NeMo-RL's prompt index in the batch ({PROMPT_ID!r}, one per row, e.g. repeated_batch[{PROMPT_ID!r}])")


def _binary(name: str, values: torch.Tensor) -> torch.Tensor:
    if not bool(((values == 0) | (values == 1)).all()):
        raise NemoRLBatchError(f"{name} must hold 0 or 1 only (a weight between would be a third aggregation); "
                               f"got values {sorted(set(values.flatten().tolist()))[:8]}")
    return values.bool()


def _refuse_cut_groups(steps: list, groups: list, rows: int, gbs: int) -> None:
    """Refuse a prompt group over two optimizer steps (or into the remainder NeMo-RL drops), each
    named by its rows and size, never by its prompt's tokens (thousands of them in a real prompt)."""
    if groups is None or len(groups) != rows or any(g is None for g in groups):
        cut_groups(steps, groups, rows)  # raises, naming the rows without a group
    members: dict = {}
    for i, key in enumerate(groups):
        members.setdefault(key, []).append(i)
    labels = [f"of rows {_some(members[key])} ({len(members[key])} rows)" for key in groups]
    cut = cut_groups(steps, labels, rows, remainder="the remainder NeMo-RL drops")
    if cut:
        more = f" (and {len(cut) - 5} more)" if len(cut) > 5 else ""
        raise NemoRLBatchError(
            "prompt_mean needs every prompt group inside one optimizer step, but NeMo-RL's steps "
            f"(policy.train_global_batch_size={gbs} rows in order) cut " + "; ".join(cut[:5]) + more
            + ": make policy.train_global_batch_size a multiple of grpo.num_generations_per_prompt and "
            "keep a prompt's generations together")


def step_fields(token_mask: torch.Tensor, sample_mask: torch.Tensor, *, gbs: int, objective: HostObjective,
                sequence_level: bool, groups: Optional[list] = None, kept_rows: Optional[torch.Tensor] = None,
                rewards: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32) -> dict:
    """The plug-in's fields for a driver batch (module docstring), host tensors.

    ``token_mask`` ``[B, T]`` and ``sample_mask`` ``[B]`` are NeMo-RL's; ``gbs``: rows per optimizer
    step (rows past the last whole step are never trained: their fields are 0); ``sequence_level``:
    NeMo-RL's ``loss_fn.token_level_loss`` is false; ``groups``: one hashable per row (prompt_mean;
    a group must lie in one step); ``kept_rows``: bool ``[B]``, the rows left in the numerator by the
    filtered numerator (None: all); ``rewards`` ``[B]``: adds :data:`NLL_SCALE`; ``dtype``: the
    fields' (the advantages'; the weights are computed in float64 and rounded once)."""
    rows, width = token_mask.shape
    tokens = _binary("token_mask", token_mask[:, 1:])
    valid = tokens & _binary("sample_mask", sample_mask).unsqueeze(1)
    numerator = valid if kept_rows is None else valid & kept_rows.bool().unsqueeze(1)
    steps = [list(range(s * gbs, (s + 1) * gbs)) for s in range(rows // gbs)]
    grouped = objective.mode == PROMPT_MEAN
    if grouped:
        _refuse_cut_groups(steps, groups, rows, gbs)
    scale = torch.zeros(rows, width, dtype=dtype)
    step_sequences = torch.zeros(rows, dtype=dtype)
    step_tokens = torch.zeros(rows, dtype=dtype)
    nll = torch.zeros(rows, width, dtype=dtype) if rewards is not None else None
    per_row = tokens.sum(1).to(torch.float64)  # M_i (the sequence level's own row count)
    for members in steps:
        part = slice(members[0], members[-1] + 1)
        lengths = torch.full((len(members),), width - 1, dtype=torch.int64)
        weights = dp_step_weights(valid[part].reshape(-1), numerator[part].reshape(-1), lengths,
                                  [groups[i] for i in members] if grouped else None,
                                  mode=objective.mode, divisor=objective.divisor)
        count_s, count_g = float(sample_mask[part].sum()), float(weights.valid_tokens)
        step_sequences[part], step_tokens[part] = count_s, count_g
        if weights.pg_weight:
            coef = weights.coef.reshape(len(members), width - 1).to(torch.float64)
            factor = (per_row[part].unsqueeze(1) * count_s) if sequence_level else count_g
            scale[part, 1:] = (coef * factor / weights.pg_weight).to(dtype)
        if nll is not None:
            correct = valid[part] & (rewards[part] > 0).unsqueeze(1)
            total = int(correct.sum())
            if total:
                nll[part, 1:] = torch.where(correct, count_g / total, 0.0).to(dtype)
    fields = {ADVANTAGE_SCALE: scale, STEP_SEQUENCES: step_sequences, STEP_TOKENS: step_tokens}
    if nll is not None:
        fields[NLL_SCALE] = nll
    return fields
