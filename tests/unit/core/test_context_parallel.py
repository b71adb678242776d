"""Megatron's THD context-parallel layout: CP rank r keeps chunks r and 2cp-1-r of each sequence."""
import pytest
import torch

from megatron_pg_agg.core.context_parallel import cp_partition_index


def test_matches_the_layout_written_out_by_hand():
    # sequence A: 8 tokens -> 4 chunks of 2 ([0,1] [2,3] [4,5] [6,7]); sequence B: 4 tokens at 8..11
    assert cp_partition_index([8, 4], 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp_partition_index([8, 4], 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    # cp = 3, one sequence of 12: chunks of 2; rank 1 keeps chunks 1 and 4
    assert cp_partition_index(torch.tensor([12]), 3, 1).tolist() == [2, 3, 8, 9]


def test_ranks_partition_every_position_exactly_once():
    for cp in (2, 3):
        lens = [2 * cp * n for n in (1, 3, 2, 5, 4)]
        seen = torch.cat([cp_partition_index(lens, cp, r) for r in range(cp)])
        assert sorted(seen.tolist()) == list(range(sum(lens)))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="divisible by 2 \\* cp_size = 4"):
        cp_partition_index([8, 6], 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        cp_partition_index([8], 2, 2)


# ----------------------------------------------------------------------------- through the planner


def _rollouts(lengths):
    """Rollouts with the given (prompt, response) lengths (odd ones included), distinct token ids
    per position so any reordering shows, masks and filtered tokens, two prompt groups."""
    import random

    from megatron_pg_agg.data.rollouts import Rollout

    rng = random.Random(5)
    out = []
    for i, (p, n) in enumerate(lengths):
        mask = [1 if rng.random() > 0.2 else 0 for _ in range(n)]
        out.append(Rollout(
            prompt_ids=[rng.randrange(1, 100) for _ in range(p)],
            response_ids=[rng.randrange(1, 100) for _ in range(n)],
            loss_mask=mask,
            advantages=[rng.uniform(-1, 1) for _ in range(n)],
            old_logprobs=[-rng.uniform(0.5, 5) for _ in range(n)],
            ref_logprobs=[-rng.uniform(0.5, 5) for _ in range(n)],
            numerator_mask=[m if rng.random() > 0.2 else 0 for m in mask],
            group_id=i % 3,
        ))
    return out


FIELDS = ("tokens", "labels", "position_ids", "numerator_mask", "denominator_mask", "advantages",
          "old_logprobs", "ref_logprobs")


def _reassemble(shards, cu_padded, cp):
    """Undo the CP split of one microbatch by hand: rank r's part of a sequence of padded length
    Lp is its chunk r then its chunk 2cp-1-r (chunks of Lp / 2cp), at offset cu_padded / cp."""
    full = torch.zeros(cu_padded[-1], dtype=shards[0].dtype)
    for k in range(len(cu_padded) - 1):
        start, length = cu_padded[k], cu_padded[k + 1] - cu_padded[k]
        chunk = length // (2 * cp)
        for r, local in enumerate(shards):
            part = local[start // cp: start // cp + 2 * chunk]
            full[start + r * chunk: start + (r + 1) * chunk] = part[:chunk]
            first = (2 * cp - 1 - r) * chunk
            full[start + first: start + first + chunk] = part[chunk:]
    return full


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_shards_of_planned_microbatches_reassemble_to_the_original_token_order(cp):
    """Every CP rank's microbatch, reassembled by hand, is the unsplit sequence: tokens in their
    original order, next-token labels, positions 0..Lp-1, response fields at the positions that
    score them, zeros in the padding; and equal to the contiguous plan (same padding, CP = 1)."""
    from megatron_pg_agg.core.losses import PGLossConfig
    from megatron_pg_agg.data.planner import PlanConfig, plan_step

    lengths = [(3, 5), (1, 6), (4, 13), (2, 1), (5, 10), (7, 9), (1, 1), (6, 17), (3, 2)]  # odd lengths
    rollouts = _rollouts(lengths)
    cfg = PGLossConfig(mode="seq_mean", kl_coef=0.1)
    sharded = [plan_step(rollouts, cfg, PlanConfig(dp_size=2, num_microbatches=2, cp_size=cp), cp_rank=r)
               for r in range(cp)]
    # the same padding (a multiple of 2cp) without the CP split: the contiguous layout
    whole = plan_step(rollouts, cfg, PlanConfig(dp_size=2, num_microbatches=2, tp_size=2 * cp,
                                                sequence_parallel=True))
    padded_somewhere = False
    for dp_rank in range(2):
        for m, contiguous in enumerate(whole.for_rank(dp_rank)):
            mbs = [plan.for_rank(dp_rank)[m] for plan in sharded]
            cu = contiguous.cu_seqlens_padded.tolist()
            assert all(mb.cu_seqlens_padded.tolist() == cu and mb.sequence_ids == contiguous.sequence_ids
                       for mb in mbs)
            got = {name: _reassemble([getattr(mb, name).reshape(-1) for mb in mbs], cu, cp) for name in FIELDS}
            got["coef"] = _reassemble([mb.token_weights.coef for mb in mbs], cu, cp)
            got["count"] = _reassemble([mb.token_weights.count for mb in mbs], cu, cp)
            for name in FIELDS:
                assert torch.equal(got[name], getattr(contiguous, name).reshape(-1)), (cp, dp_rank, m, name)
            assert torch.equal(got["coef"], contiguous.token_weights.coef)
            assert torch.equal(got["count"], contiguous.token_weights.count)
            # and against the rollouts themselves, position by position
            for k, s in enumerate(contiguous.sequence_ids):
                r = rollouts[s]
                seq = list(r.prompt_ids) + list(r.response_ids)
                p, start, lp = len(r.prompt_ids), cu[k], cu[k + 1] - cu[k]
                assert lp % (2 * cp) == 0 and lp - len(seq) < 2 * cp
                padded_somewhere |= lp > len(seq)
                assert got["tokens"][start:start + lp].tolist() == seq + [0] * (lp - len(seq))
                assert got["labels"][start:start + lp].tolist() == seq[1:] + [0] * (lp - len(seq) + 1)
                assert got["position_ids"][start:start + lp].tolist() == list(range(lp))
                scored = slice(start + p - 1, start + p - 1 + len(r.response_ids))
                assert got["denominator_mask"][scored].tolist() == [bool(x) for x in r.loss_mask]
                assert got["numerator_mask"][scored].tolist() == [bool(x) for x in r.numerator_mask]
                expect_adv = torch.tensor([a if d else 0.0 for a, d in zip(r.advantages, r.loss_mask)])
                assert torch.equal(got["advantages"][scored], expect_adv)
                outside = torch.ones(lp, dtype=torch.bool)
                outside[p - 1:p - 1 + len(r.response_ids)] = False
                assert not got["denominator_mask"][start:start + lp][outside].any()
    assert padded_somewhere
