"""Megatron's THD context-parallel layout: CP rank r keeps chunks r and 2cp-1-r of each sequence."""
import pytest
import torch

from megatron_pg_agg.context_parallel import cp_partition_index


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
