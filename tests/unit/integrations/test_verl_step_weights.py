"""The plug-ins' step weights across DP ranks (``step_weights.global_layout`` + ``token_weights``),
against the mode formulas written here, without verl: each "rank" sees only its own rows' masks and
every rank's per-row valid-token counts (what one ``all_gather_object`` gives it)."""
import pytest
import torch

from megatron_pg_agg.core.aggregation import token_weights
from megatron_pg_agg.integrations.step_weights import dp_step_weights, global_layout

# two DP ranks, rows as (group, response mask); group "b" is split across the ranks, row 2 is empty
RANKS = [
    [("a", [1, 1, 0]), ("a", [1]), ("b", [0, 0])],
    [("b", [1, 1, 1, 1]), ("c", [1, 0, 1]), ("a", [1, 1])],
]


def weights_on(rank: int, mode: str, divisor=None):
    rows = RANKS[rank]
    lengths = torch.tensor([len(m) for _, m in rows])
    mask = torch.tensor([v for _, m in rows for v in m], dtype=torch.bool)
    gathered = [([g for g, _ in r], [sum(m) for _, m in r]) for r in RANKS]
    num, den, cu, groups, local = global_layout(mask, mask, lengths, gathered, rank, mode == "prompt_mean")
    step = token_weights(num, mode=mode, divisor=divisor, cu_seqlens=cu, group_sizes=groups, denominator_mask=den)
    return step.coef[local].tolist(), int(step.count.sum())


def f32(values):  # c_t is float32 (the contract): 1/5 as float32
    return pytest.approx(values, rel=1e-7, abs=0)


def test_prompt_mean_pools_a_group_across_ranks():
    # group a: 2 + 1 (rank 0) + 2 (rank 1) = 5 valid tokens; b: 0 + 4 = 4; c: 2; three active groups
    coef0, w0 = weights_on(0, "prompt_mean")
    coef1, w1 = weights_on(1, "prompt_mean")
    assert w0 == w1 == 3
    assert coef0 == f32([1 / 5, 1 / 5, 0.0, 1 / 5, 0.0, 0.0])
    assert coef1 == f32([1 / 4] * 4 + [1 / 2, 0.0, 1 / 2] + [1 / 5, 1 / 5])


def test_seq_mean_token_mean_and_constant_count_every_rank():
    coef0, w = weights_on(0, "seq_mean")
    assert w == 5 and coef0 == f32([1 / 2, 1 / 2, 0.0, 1.0, 0.0, 0.0])  # 5 active responses of 6
    assert weights_on(1, "token_mean")[1] == 2 + 1 + 4 + 2 + 2  # every valid token of both ranks
    coef1, w = weights_on(1, "constant", divisor=8.0)
    assert w == 5 and coef1 == f32([1 / 8] * 4 + [1 / 8, 0.0, 1 / 8] + [1 / 8] * 2)


def test_a_step_with_no_valid_token_has_zero_weights():
    lengths = torch.tensor([2, 1])
    mask = torch.zeros(3, dtype=torch.bool)
    num, den, cu, groups, local = global_layout(mask, mask, lengths, [(["a", "a"], [0, 0])], 0, True)
    step = token_weights(num, mode="prompt_mean", cu_seqlens=cu, group_sizes=groups, denominator_mask=den)
    assert int(step.count.sum()) == 0 and step.coef[local].tolist() == [0.0, 0.0, 0.0]


def test_dp_step_weights_on_one_rank_equals_the_layout_and_token_weights():
    """The shared entry without a DP group: the same weights as the layout test above on rank 0
    alone (catches the counts or the local index taken wrongly in dp_step_weights)."""
    rows = [("a", [1, 1, 0]), ("a", [1]), ("b", [0, 1])]
    lengths = torch.tensor([len(m) for _, m in rows])
    mask = torch.tensor([v for _, m in rows for v in m], dtype=torch.bool)
    step = dp_step_weights(mask, mask, lengths, [g for g, _ in rows], mode="prompt_mean", divisor=None)
    assert step.pg_weight == 2 and step.valid_tokens == 4
    assert step.coef.tolist() == f32([1 / 3, 1 / 3, 0.0, 1 / 3, 0.0, 1.0])
