"""The planner's packed layout against a plain per-sequence construction, field by field and bit
for bit; its two weight paths (rollouts already grouped, or reordered) against each other; its
longest-first assignment against the tuple-heap formulation. The planner builds every per-token
index with running sums (see ``token_layout``): an off-by-one at a prompt, response or padding
boundary, or a masked value leaking through, shows here as a field that differs."""
from __future__ import annotations

import dataclasses
import heapq
import random

import pytest
import torch

from megatron_pg_agg.core.aggregation import token_weights
from megatron_pg_agg.core.context_parallel import cp_partition_index
from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data import planner
from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.data.rollouts import RolloutBatch


def _batch(seed: int, *, grouped: bool, filtering: bool, engine: bool = False) -> RolloutBatch:
    """Ragged prompts and responses (single tokens included), masked positions holding NaN and
    inf (they must never be read), some fully masked sequences."""
    g = torch.Generator().manual_seed(seed)
    n = 23
    prompt = torch.randint(1, 9, (n,), generator=g)
    resp = torch.randint(1, 14, (n,), generator=g)
    r_total = int(resp.sum())
    mask = torch.rand(r_total, generator=g) > 0.3
    mask[: int(resp[0])] = False  # a sequence with no valid token
    nan = torch.tensor(float("nan"))
    kw = {}
    if filtering:
        kw["numerator_mask"] = mask & (torch.rand(r_total, generator=g) > 0.3)
    if engine:
        kw["rollout_logprobs"] = torch.where(mask, -torch.rand(r_total, generator=g) * 3, nan)
    groups = torch.arange(n) // 3 if grouped else torch.randint(0, 6, (n,), generator=g) * 7 - 11
    return RolloutBatch(
        prompt_lengths=prompt, response_lengths=resp,
        prompt_tokens=torch.randint(0, 500, (int(prompt.sum()),), generator=g),
        response_tokens=torch.randint(0, 500, (r_total,), generator=g),
        loss_mask=mask,
        advantages=torch.where(mask, torch.randn(r_total, generator=g), float("inf")),
        old_logprobs=torch.where(mask, -torch.rand(r_total, generator=g) * 3, nan),
        ref_logprobs=torch.where(mask, -torch.rand(r_total, generator=g) * 3, nan),
        group_index=groups, **kw)


def _expected_sequence(batch: RolloutBatch, i: int, padded: int, numerator: torch.Tensor) -> dict:
    """One sequence's fields, written out position by position (the module docstring's rule:
    position P + j - 1 scores response token j; the last real position and padding score nothing)."""
    p_start = int(batch.prompt_lengths[:i].sum())
    r_start = int(batch.response_lengths[:i].sum())
    p, r = int(batch.prompt_lengths[i]), int(batch.response_lengths[i])
    ids = batch.prompt_tokens[p_start:p_start + p].tolist() + batch.response_tokens[r_start:r_start + r].tolist()
    ids += [0] * (padded - p - r)
    out = {"tokens": ids, "labels": ids[1:p + r] + [0] * (padded - p - r + 1), "position_ids": list(range(padded)),
           "denominator_mask": [False] * padded, "numerator_mask": [False] * padded,
           "advantages": [0.0] * padded, "old_logprobs": [0.0] * padded, "ref_logprobs": [0.0] * padded}
    for j in range(r):
        t, k = p + j - 1, r_start + j
        if t < 0:
            continue
        valid = bool(batch.loss_mask[k])
        out["denominator_mask"][t] = valid
        out["numerator_mask"][t] = bool(numerator[k])
        if valid:
            for name in ("advantages", "old_logprobs", "ref_logprobs"):
                out[name][t] = float(getattr(batch, name)[k])
    return out


@pytest.mark.parametrize("cp, sequence_parallel", [(1, False), (1, True), (2, False), (3, True)])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("filtering", [True, False])
def test_every_per_token_field_matches_a_per_sequence_construction(cp, sequence_parallel, grouped, filtering):
    batch = _batch(cp * 10 + grouped * 2 + filtering, grouped=grouped, filtering=filtering)
    plan_cfg = PlanConfig(dp_size=2, num_microbatches=2, cp_size=cp, tp_size=4 if sequence_parallel else 1,
                          sequence_parallel=sequence_parallel)
    numerator = batch.loss_mask if batch.numerator_mask is None else batch.numerator_mask
    dtypes = {"tokens": torch.long, "labels": torch.long, "position_ids": torch.long,
              "denominator_mask": torch.bool, "numerator_mask": torch.bool,
              "advantages": torch.float32, "old_logprobs": torch.float32, "ref_logprobs": torch.float32}
    for cp_rank in range(cp):
        plan = plan_step(batch, PGLossConfig(mode="seq_mean", kl_coef=0.1), plan_cfg, cp_rank=cp_rank)
        for mb in (m for row in plan.microbatches for m in row):
            padded = (mb.cu_seqlens_padded[1:] - mb.cu_seqlens_padded[:-1]).tolist()
            seqs = [_expected_sequence(batch, i, n, numerator) for i, n in zip(mb.sequence_ids, padded)]
            kept = cp_partition_index(padded, cp, cp_rank) if cp > 1 else torch.arange(sum(padded))
            for name, dtype in dtypes.items():
                want = torch.tensor([v for s in seqs for v in s[name]], dtype=dtype)[kept]
                got = getattr(mb, name).reshape(-1)
                assert got.dtype == dtype, name
                # bitwise: masked positions must be +0.0, never NaN, inf or -0.0 from the data
                same = torch.equal(got.view(torch.int32), want.view(torch.int32)) if dtype == torch.float32 \
                    else torch.equal(got, want)
                assert same, (name, cp_rank)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "prompt_mean", "constant"])
@pytest.mark.parametrize("correction", [None, "token_mask", "sequence_truncate"])
def test_reordered_rollouts_take_the_general_weight_path_with_the_same_result(mode, correction):
    """Rollouts already in canonical order take the shortcut (weights computed in place); the
    general path (masks gathered into canonical order, weights gathered back) must give the
    same plan bit for bit when forced on the same batch."""
    batch = _batch(5, grouped=True, filtering=True, engine=True)
    cfg = PGLossConfig(mode=mode, divisor=8.0 if mode == "constant" else None, rollout_correction=correction)
    plan_cfg = PlanConfig(dp_size=2, num_microbatches=2)
    order = planner.canonical_order(batch, plan_cfg)
    assert order.identity
    checked, _ = planner.checked_batch(batch, cfg, plan_cfg)
    fast = planner.step_weights(checked, order, cfg)
    general = planner.step_weights(checked, dataclasses.replace(order, identity=False), cfg)
    for a, b in ((fast.weights.coef, general.weights.coef), (fast.weights.count, general.weights.count),
                 (fast.denominator, general.denominator), (fast.numerator, general.numerator)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert fast.totals == general.totals
    # and both equal token_weights on the response tokens, with the "nothing" entry at 0
    num = checked.loss_mask if checked.numerator_mask is None else checked.numerator_mask
    direct = token_weights(num, mode=mode, divisor=cfg.divisor, denominator_mask=checked.loss_mask,
                           cu_seqlens=order.r_start, group_sizes=order.group_sizes)
    assert torch.equal(fast.weights.coef[:-1], direct.coef) and torch.equal(fast.weights.count[:-1], direct.count)
    assert float(fast.weights.coef[-1]) == 0 and int(fast.weights.count[-1]) == 0


def _lpt_reference(lengths: list, num_bins: int) -> list:
    heap = [(0, b) for b in range(num_bins)]
    bins = [[] for _ in range(num_bins)]
    for idx in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(idx)
        heapq.heappush(heap, (load + lengths[idx], b))
    return [sorted(b) for b in bins]


@pytest.mark.parametrize("seed", range(5))
def test_longest_first_assignment_matches_the_tuple_heap(seed):
    """The int-keyed heap (load * bins + bin) and the stable reverse sort keep the (load, bin)
    order and the ties by index: the same bins as the plain formulation, ties included."""
    rnd = random.Random(seed)
    lengths = [rnd.choice([1, 2, 3, 64, 64, 200, rnd.randint(1, 5000)]) for _ in range(rnd.randint(1, 400))]
    for num_bins in (1, 3, 16, 128):
        assert planner._lpt_bins(lengths, num_bins) == _lpt_reference(lengths, num_bins)


def test_ramps_fill_each_run_with_consecutive_values():
    starts, values, lengths = torch.tensor([0, 3, 3, 5]), torch.tensor([10, -4, 7, 0]), torch.tensor([3, 0, 2, 4])
    for dtype in (torch.int32, torch.long):
        got = planner._ramps(starts, values, lengths, 9, dtype)
        assert got.dtype == dtype and got.tolist() == [10, 11, 12, 7, 8, 0, 1, 2, 3]
