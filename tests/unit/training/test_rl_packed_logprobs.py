"""The packed log-prob passes' layout, without Megatron-LM (issue 40): the collection planned as one
step of packed THD microbatches, and every rank's microbatch positions laid back into Megatron-LM's
log-prob rows ``[N, S-1]`` (position ``p - 1`` of row ``i`` scores token ``p``).

The reference is the trajectories themselves: every token id is unique, and each microbatch's
"log-prob" at a position is its label (the token that position scores), so the rows must hold
``trajs[i, j + 1]`` at column ``j`` for every ``j < n_i - 1`` after the ranks' rows are summed.
An off-by-one column, another rank's row, a CP chunk misplaced or a position written twice fails."""
from __future__ import annotations

import pytest
import torch

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.training.rl_collection import CollectionShape, collection_batch, row_positions

PAD = 0


def _collection(groups: int, group_size: int, seq_length: int, seed: int = 0):
    """Megatron-LM's padded trajectory rows with unique token ids, generation masks, lengths."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * group_size
    lengths = torch.randint(4, seq_length + 1, (n,), generator=gen)
    lengths[0] = seq_length  # one trajectory of the full --seq-length
    trajs = torch.full((n, seq_length), PAD, dtype=torch.long)
    mask = torch.zeros((n, seq_length), dtype=torch.bool)
    for i in range(n):
        k = int(lengths[i])
        trajs[i, :k] = 1000 * (i + 1) + torch.arange(k)
        prompt = int(torch.randint(1, k - 1, (1,), generator=gen))
        mask[i, prompt:k] = True
    return trajs, mask, lengths


def _rows_from_plan(trajs, mask, lengths, shape, plan_cfg) -> tuple:
    """The rows every rank would write, summed (the DP x CP all-reduce), and how often each entry
    was written."""
    n, width = trajs.shape[0], trajs.shape[1] - 1
    rows = torch.zeros(n * width)
    writes = torch.zeros(n * width, dtype=torch.long)
    batch = collection_batch(trajs, mask, lengths, PAD, shape)
    for cp_rank in range(plan_cfg.cp_size):
        plan = plan_step(batch, PGLossConfig(), plan_cfg, cp_rank=cp_rank)
        for dp_rank in range(plan_cfg.dp_size):
            mbs = plan.for_rank(dp_rank)
            src, dst = row_positions(mbs, lengths, width, cp_size=plan_cfg.cp_size, cp_rank=cp_rank)
            fake = torch.cat([mb.labels[0].float() for mb in mbs])  # "log-prob" = the scored token
            rows.index_add_(0, dst, fake.index_select(0, src))
            writes.index_add_(0, dst, torch.ones_like(dst))
    return rows.view(n, width), writes.view(n, width), plan


@pytest.mark.parametrize("dp,cp,pp_tokens,capacity", [
    (1, 1, None, 64), (2, 1, None, 64), (2, 1, None, 160), (1, 2, None, 64), (2, 2, None, 128), (2, 1, 64, 64),
])
def test_every_scored_position_lands_once_in_its_row_and_column(dp, cp, pp_tokens, capacity):
    seq_length = 64
    trajs, mask, lengths = _collection(groups=6, group_size=4, seq_length=seq_length)
    shape = CollectionShape(prompts=6, group_size=4, global_batch=8, passes=2)
    plan_cfg = PlanConfig(dp_size=dp, cp_size=cp, max_tokens_per_microbatch=capacity, microbatch_tokens=pp_tokens)
    rows, writes, plan = _rows_from_plan(trajs, mask, lengths, shape, plan_cfg)
    scored = torch.arange(seq_length - 1).unsqueeze(0) < (lengths - 1).unsqueeze(1)
    assert torch.equal(writes, scored.long())  # every scored entry once, nothing else
    want = torch.where(scored, trajs[:, 1:].float(), torch.zeros(()))
    assert torch.equal(rows, want)
    # packed: fewer microbatches than sequences per rank, each within the capacity
    assert plan.stats["microbatches_per_rank"] < trajs.shape[0] // dp
    assert max(t for rank in plan.bin_tokens for t in rank) <= capacity


def test_the_layout_batch_holds_every_sequence_whole_in_row_order():
    trajs, mask, lengths = _collection(groups=3, group_size=2, seq_length=32, seed=1)
    batch = collection_batch(trajs, mask, lengths, PAD, CollectionShape(3, 2, 2, 1))
    assert len(batch) == 6
    assert torch.equal(batch.prompt_lengths + batch.response_lengths, lengths)
    assert batch.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    first = batch.response_tokens[torch.cat([torch.zeros(1, dtype=torch.long),
                                             batch.response_lengths.cumsum(0)[:-1]])]
    assert first.tolist() == [int(trajs[i, int(mask[i].int().argmax())]) for i in range(6)]


def test_the_layout_batch_is_the_steps_cut_as_one_step():
    """The vectorised layout batch equals :func:`step_batches`' cut of the collection as one step
    (the steps' own prompt/response split and loss mask)."""
    from megatron_pg_agg.training.rl_collection import step_batches

    trajs, mask, lengths = _collection(groups=3, group_size=2, seq_length=32, seed=2)
    trajs[1, int(lengths[1]) - 1] = PAD  # a pad-id eod: out of the loss mask in both
    shape = CollectionShape(3, 2, 2, 1)
    batch = collection_batch(trajs, mask, lengths, PAD, shape)
    (want,) = step_batches(tokens=trajs, generation_mask=mask, lengths=lengths, pad=PAD,
                           advantages=torch.zeros(6, dtype=torch.float64), old_logprobs=torch.zeros(6, 31),
                           ref_logprobs=None, rollout_logprobs=None, shape=CollectionShape(3, 2, 6, 1))
    for name in ("prompt_lengths", "response_lengths", "prompt_tokens", "response_tokens", "loss_mask",
                 "group_index"):
        assert torch.equal(getattr(batch, name), getattr(want, name)), name
    assert not bool(batch.loss_mask.all())


def _steps_row_by_row(tokens, generation_mask, lengths, pad, advantages, old, ref, rollout, shape):
    """The cut into steps one row at a time (the loop step_batches replaced): the reference."""
    out = []
    for k in range(shape.steps):
        rows = range(k * shape.global_batch, (k + 1) * shape.global_batch)
        fields = {name: [] for name in ("prompt", "response", "mask", "adv", "old", "ref", "rollout")}
        for i in rows:
            f, n = int(generation_mask[i].int().argmax()), int(lengths[i])
            fields["prompt"].append(tokens[i, :f])
            fields["response"].append(tokens[i, f:n])
            fields["mask"].append(generation_mask[i, f:n] & (tokens[i, f:n] != pad))
            fields["adv"].append(advantages[i].float().expand(n - f))
            for name, values in (("old", old), ("ref", ref), ("rollout", rollout)):
                if values is not None:
                    fields[name].append(values[i, f - 1:n - 1])
        out.append({name: torch.cat(v) if v else None for name, v in fields.items()})
    return out


def test_the_vectorised_cut_into_steps_equals_the_row_by_row_cut_bit_for_bit():
    trajs, mask, lengths = _collection(groups=6, group_size=4, seq_length=48, seed=3)
    trajs[5, int(lengths[5]) - 1] = PAD
    gen = torch.Generator().manual_seed(4)
    advantages = torch.randn(24, generator=gen, dtype=torch.float64)
    old, ref, rollout = (-torch.rand(24, 47, generator=gen) * 5 for _ in range(3))
    shape = CollectionShape(prompts=6, group_size=4, global_batch=8, passes=2)
    for with_ref, with_rollout in ((True, True), (False, False)):
        steps = step_batches_under_test(trajs, mask, lengths, advantages, old, ref if with_ref else None,
                                        rollout if with_rollout else None, shape)
        want = _steps_row_by_row(trajs, mask, lengths, PAD, advantages, old, ref if with_ref else None,
                                 rollout if with_rollout else None, shape)
        assert len(steps) == len(want) == 3
        for k, (got, ref_fields) in enumerate(zip(steps, want)):
            pairs = {"prompt_tokens": "prompt", "response_tokens": "response", "loss_mask": "mask",
                     "advantages": "adv", "old_logprobs": "old", "ref_logprobs": "ref", "rollout_logprobs": "rollout"}
            for name, key in pairs.items():
                value, expected = getattr(got, name), ref_fields[key]
                if expected is None:
                    assert value is None, (k, name)
                else:
                    assert torch.equal(value, expected.to(value.dtype)), (k, name)
            assert got.group_index.tolist() == [i // 4 for i in range(8 * k, 8 * k + 8)]
            assert torch.equal(got.prompt_lengths + got.response_lengths, lengths[8 * k:8 * k + 8])


def step_batches_under_test(trajs, mask, lengths, advantages, old, ref, rollout, shape):
    from megatron_pg_agg.training.rl_collection import step_batches

    return step_batches(tokens=trajs, generation_mask=mask, lengths=lengths, pad=PAD, advantages=advantages,
                        old_logprobs=old, ref_logprobs=ref, rollout_logprobs=rollout, shape=shape)
